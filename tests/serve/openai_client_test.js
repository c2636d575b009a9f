// vlmgen-serve through the official OpenAI client (npm `openai`, pinned in tests/text/js).
//   node openai_client_test.js URL API_KEY EXPECTED_JSON IMAGE.png
// EXPECTED_JSON (written by serve_test.sh from vlmgen-chat): {text, prompt_tokens, completion_tokens}.
// Exits non-zero on the first failed check, printing what differed.
'use strict';
const fs = require('fs');
const http = require('http');
const net = require('net');
const zlib = require('zlib');
const OpenAI = require('openai');

const [url, apiKey, expectedPath, imagePath] = process.argv.slice(2);
const expected = JSON.parse(fs.readFileSync(expectedPath, 'utf8'));
const client = new OpenAI({ baseURL: url + '/v1', apiKey, maxRetries: 0, timeout: 120000 });
const imageUrl = 'data:image/png;base64,' + fs.readFileSync(imagePath).toString('base64');
const imageMessages = [{ role: 'user', content: [{ type: 'image_url', image_url: { url: imageUrl } },
                                                 { type: 'text', text: 'Describe this image.' }] }];
let checks = 0;
function check(ok, what, detail) {
  checks++;
  if (!ok) {
    console.error('FAIL: ' + what + (detail === undefined ? '' : ': ' + JSON.stringify(detail)));
    process.exit(1);
  }
}

async function streamed(body) {
  const stream = await client.chat.completions.create({ ...body, stream: true, stream_options: { include_usage: true } });
  const out = { text: '', role: null, finish: null, usage: null, chunks: 0, logprobs: [] };
  for await (const chunk of stream) {
    out.chunks++;
    if (chunk.usage) out.usage = chunk.usage;
    for (const choice of chunk.choices) {
      if (choice.delta.role) out.role = choice.delta.role;
      if (choice.delta.content) out.text += choice.delta.content;
      if (choice.logprobs && choice.logprobs.content) out.logprobs.push(...choice.logprobs.content);
      if (choice.finish_reason) out.finish = choice.finish_reason;
    }
  }
  return out;
}

async function raw(path, init) {
  const headers = Object.assign({ 'Content-Type': 'application/json', Authorization: 'Bearer ' + apiKey },
                                (init && init.headers) || {});
  const res = await fetch(url + path, Object.assign({}, init, { headers }));
  const text = await res.text();
  let body = null;
  try { body = JSON.parse(text); } catch (e) { body = text; }
  return { status: res.status, body, headers: res.headers };
}

// The status of the first response to `text` written as is on a new connection.
function rawStatus(text) {
  return new Promise((resolve, reject) => {
    const u = new URL(url);
    const socket = net.connect(Number(u.port), u.hostname, () => socket.write(text));
    let got = '';
    const timer = setTimeout(() => { socket.destroy(); resolve(got === '' ? 'no answer in 5 s' : got); }, 5000);
    socket.on('data', (d) => {
      got += d;
      if (got.includes('\r\n\r\n')) { clearTimeout(timer); socket.destroy(); resolve(Number(got.split(' ')[1])); }
    });
    socket.on('error', (e) => { clearTimeout(timer); reject(e); });
  });
}

// A POST whose body is sent chunked (Transfer-Encoding, no Content-Length).
function chunked(path, text) {
  return new Promise((resolve, reject) => {
    const u = new URL(url + path);
    const req = http.request({ hostname: u.hostname, port: u.port, path: u.pathname, method: 'POST',
                               headers: { 'Content-Type': 'application/json', Authorization: 'Bearer ' + apiKey } }, (res) => {
      let body = '';
      res.on('data', (d) => { body += d; });
      res.on('end', () => { try { body = JSON.parse(body); } catch (e) { /* the text */ } resolve({ status: res.statusCode, body }); });
    });
    req.on('error', reject);
    req.write(text);  // no Content-Length given: Node sends it chunked
    req.end();
  });
}

async function metric(name) {
  const m = await raw('/metrics', { method: 'GET' });
  const line = m.body.split('\n').find((l) => l.startsWith(name + ' ') || l.startsWith(name + '{') && l.includes(name));
  return line === undefined ? 0 : Number(line.split(' ').pop());
}
async function statusCount(status) {
  const m = await raw('/metrics', { method: 'GET' });
  const line = m.body.split('\n').find((l) => l.startsWith(`vlmgen_requests_total{status="${status}"}`));
  return line === undefined ? 0 : Number(line.split(' ').pop());
}

// A PNG that declares width x height: black pixels (full), or a header whose pixels are never reached.
function pngHeader(width, height, full) {
  const crcTable = Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  const crc = (buf) => { let c = 0xffffffff; for (const b of buf) c = crcTable[(c ^ b) & 0xff] ^ (c >>> 8); return (c ^ 0xffffffff) >>> 0; };
  const chunk = (type, data) => {
    const body = Buffer.concat([Buffer.from(type, 'ascii'), data]);
    const len = Buffer.alloc(4); len.writeUInt32BE(data.length);
    const sum = Buffer.alloc(4); sum.writeUInt32BE(crc(body));
    return Buffer.concat([len, body, sum]);
  };
  const ihdr = Buffer.alloc(13);
  ihdr.writeUInt32BE(width, 0); ihdr.writeUInt32BE(height, 4); ihdr[8] = 8; ihdr[9] = 2;
  const idat = zlib.deflateSync(Buffer.alloc(full ? height * (1 + 3 * width) : 64));  // filter byte 0 a row
  return Buffer.concat([Buffer.from([137, 80, 78, 71, 13, 10, 26, 10]), chunk('IHDR', ihdr), chunk('IDAT', idat),
                        chunk('IEND', Buffer.alloc(0))]);
}

async function main() {
  // Models, health.
  const models = await client.models.list();
  check(models.data.length === 1 && models.data[0].object === 'model', 'GET /v1/models lists the model', models.data);
  check((await raw('/health', { method: 'GET' })).status === 200, 'GET /health');

  // 1. Non-streaming with an image: vlmgen-chat's text and token counts.
  const greedy = { model: models.data[0].id, messages: imageMessages, max_tokens: expected.max_tokens, temperature: 0 };
  const r = await client.chat.completions.create(greedy);
  check(r.object === 'chat.completion' && r.choices.length === 1, 'a chat.completion with one choice', r);
  check(r.choices[0].message.role === 'assistant', 'the assistant role');
  check(r.choices[0].message.content === expected.text, 'the text equals vlmgen-chat\'s',
        { served: r.choices[0].message.content, chat: expected.text });
  check(r.usage.prompt_tokens === expected.prompt_tokens && r.usage.completion_tokens === expected.completion_tokens &&
        r.usage.total_tokens === expected.prompt_tokens + expected.completion_tokens, 'usage counts', r.usage);
  console.log('OK non-streaming: ' + JSON.stringify(r.choices[0].message.content) + ' ' + JSON.stringify(r.usage) +
              ' finish ' + r.choices[0].finish_reason);

  // 2. Streaming: role chunk, content deltas, finish_reason, usage, [DONE] (the client stops there).
  const s = await streamed(greedy);
  check(s.role === 'assistant', 'the stream opens with the assistant role', s);
  check(s.text === expected.text, 'the streamed text equals vlmgen-chat\'s', { streamed: s.text, chat: expected.text });
  check(s.finish === r.choices[0].finish_reason, 'the stream ends with the same finish_reason', s);
  check(s.usage && s.usage.completion_tokens === expected.completion_tokens &&
        s.usage.prompt_tokens === expected.prompt_tokens, 'stream_options.include_usage', s.usage);
  console.log(`OK streaming: ${s.chunks} chunks, same text and usage`);

  // 3. Stop strings, matched on the text (a stop string that spans tokens included).
  const points = [...expected.text];
  if (points.length >= 6) {
    const stop = points.slice(2, 5).join('');
    const cut = expected.text.slice(0, expected.text.indexOf(stop));
    const a = await client.chat.completions.create({ ...greedy, stop: [stop] });
    check(a.choices[0].message.content === cut && a.choices[0].finish_reason === 'stop', 'stop string cuts the text',
          { got: a.choices[0].message.content, want: cut });
    const b = await streamed({ ...greedy, stop });
    check(b.text === cut && b.finish === 'stop', 'stop string cuts the stream', { got: b.text, want: cut });
    console.log('OK stop ' + JSON.stringify(stop) + ' -> ' + JSON.stringify(cut));
  } else {
    console.log('note: the expected text is too short for the stop-string check');
  }

  // 4. Log-probabilities.
  const lp = await client.chat.completions.create({ ...greedy, logprobs: true, top_logprobs: 2 });
  const content = lp.choices[0].logprobs.content;
  check(content.length === lp.usage.completion_tokens, 'one logprob entry per token', content.length);
  for (const e of content) {
    check(e.logprob <= 0 && e.top_logprobs.length === 2 && Math.abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4,
          'greedy: the chosen token is the most likely one', e);
  }
  // Streamed: the same entries, top alternatives included, spread over the chunks.
  const slp = await streamed({ ...greedy, logprobs: true, top_logprobs: 2 });
  check(slp.logprobs.length === content.length, 'streamed: one logprob entry per token', slp.logprobs.length);
  for (let i = 0; i < content.length; i++) {
    const a = content[i], b = slp.logprobs[i];
    check(a.token === b.token && Math.abs(a.logprob - b.logprob) < 1e-6 && b.top_logprobs.length === 2 &&
          b.top_logprobs.every((t, j) => t.token === a.top_logprobs[j].token &&
                                         Math.abs(t.logprob - a.top_logprobs[j].logprob) < 1e-6),
          'streamed logprobs and top_logprobs equal the non-streamed ones', { i, a, b });
  }
  console.log('OK logprobs (streamed too)');
  // Each entry's bytes are its token's own: joined, they rebuild the text, also where a character
  // is split over tokens (sampled from the tiny model's byte-level vocabulary until one is).
  // Answers holding a special token (text without it) or an id past the tokenizer (no bytes,
  // U+FFFD in the text) are skipped: the tiny model samples nearly uniformly.
  let split = null, compared = 0;
  for (let seed = 1; seed <= 32 && split === null; seed++) {
    const r = await client.chat.completions.create({ messages: [{ role: 'user', content: 'hi' }], max_tokens: 100,
                                                     temperature: 1, seed, logprobs: true });
    const entries = r.choices[0].logprobs.content;
    const text = entries.slice(0, r.choices[0].finish_reason === 'length' ? entries.length : -1);  // an end token is not text
    if (text.some((e) => e.bytes.length === 0 || /^<\|[a-z_]+\|>$/.test(e.token))) continue;
    compared++;
    const joined = new TextDecoder().decode(Buffer.concat(text.map((e) => Buffer.from(e.bytes))));
    check(joined === r.choices[0].message.content, 'the logprob entries\' bytes rebuild the text', { seed, joined, content: r.choices[0].message.content });
    const alone = (e) => { try { new TextDecoder('utf-8', { fatal: true }).decode(Buffer.from(e.bytes)); return true; } catch { return false; } };
    if (text.some((e) => !alone(e))) split = seed;  // a token holding part of a character: its bytes alone are not UTF-8
  }
  check(split !== null, 'some sampled answer has a token whose own bytes are part of a character', { compared });
  console.log(`OK logprob bytes rebuild the text in ${compared} answers (a split character at seed ${split})`);

  // 5. Load: 64 requests from 16 at a time, mixed, each equal to its single-request result.
  const variants = [
    { messages: imageMessages },
    { messages: [{ role: 'user', content: 'Say something.' }] },
    { messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: [{ type: 'text', text: 'Hi' }] }] },
    { messages: [{ role: 'user', content: [{ type: 'text', text: 'Again:' }, { type: 'image_url', image_url: { url: imageUrl } }] }] },
  ];
  const single = [];
  for (const v of variants) {
    single.push((await client.chat.completions.create({ model: 'm', max_tokens: 8, temperature: 0, ...v })).choices[0].message.content);
  }
  const before200 = await statusCount(200);
  let next = 0, done = 0;
  const results = new Array(64);
  async function worker() {
    while (next < 64) {
      const i = next++;
      const v = variants[i % variants.length];
      const body = { model: 'm', max_tokens: 8, temperature: 0, ...v };
      results[i] = i % 2 ? (await streamed(body)).text : (await client.chat.completions.create(body)).choices[0].message.content;
      done++;
    }
  }
  await Promise.all(Array.from({ length: 16 }, worker));
  check(done === 64, '64 requests finished', done);
  for (let i = 0; i < 64; i++) check(results[i] === single[i % variants.length], `request ${i} equals its single result`, { got: results[i], want: single[i % variants.length] });
  const after200 = await statusCount(200);
  check(after200 - before200 === 64, '/metrics counted the 64 requests', { before200, after200 });
  console.log('OK load: 64 requests, 16 at a time, each equal to its single result');

  // 6. Bad requests: status, OpenAI error object naming the field; the server keeps serving.
  const post = (body, extra) => raw('/v1/chat/completions', Object.assign({ method: 'POST', body: typeof body === 'string' || Buffer.isBuffer(body) ? body : JSON.stringify(body) }, extra));
  const ok = { model: 'm', messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2 };
  const images = (n, url) => [{ role: 'user', content: Array.from({ length: n }, () => ({ type: 'image_url', image_url: { url } })) }];
  const black = 'data:image/png;base64,' + pngHeader(1000, 1000, true).toString('base64');
  const bad = [
    ['not JSON', '{"messages": [', 400, null],
    ['an array body', '[1, 2]', 400, null],
    ['JSON nested 100000 deep', '['.repeat(100000) + ']'.repeat(100000), 400, null],
    ['no messages', { model: 'm' }, 400, 'messages'],
    ['messages not an array', { messages: 'hi' }, 400, 'messages'],
    ['empty messages', { messages: [] }, 400, 'messages'],
    ['unknown role', { messages: [{ role: 'robot', content: 'hi' }] }, 400, 'messages[0].role'],
    ['content a number', { messages: [{ role: 'user', content: 5 }] }, 400, 'messages[0].content'],
    ['no content', { messages: [{ role: 'user' }] }, 400, 'messages[0].content'],
    ['unknown part type', { messages: [{ role: 'user', content: [{ type: 'audio', audio: 'x' }] }] }, 400, 'messages[0].content[0].type'],
    ['remote image URL', { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'https://example.com/a.png' } }] }] }, 400, 'messages[0].content[0].image_url.url'],
    ['local path without --allow-local-images', { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: '/etc/passwd' } }] }] }, 400, 'messages[0].content[0].image_url.url'],
    ['bad base64', { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'data:image/png;base64,@@@@' } }] }] }, 400, 'messages[0].content[0].image_url.url'],
    ['a GIF data URL', { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'data:image/gif;base64,R0lGOD==' } }] }] }, 400, 'messages[0].content[0].image_url.url'],
    ['undecodable image', { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'data:image/png;base64,' + Buffer.from('not a png at all').toString('base64') } }] }] }, 400, 'messages[0].content[0].image_url.url'],
    ['image above --max-image-pixels', { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'data:image/png;base64,' + pngHeader(30000, 30000).toString('base64') } }] }] }, 400, 'messages[0].content[0].image_url.url'],
    ['17 images (--max-images 16)', { ...ok, messages: images(17, 'data:image/png;base64,' + Buffer.from('x').toString('base64')) }, 400, 'messages'],
    ['2M pixels in two images (--max-total-image-pixels 1500000)', { ...ok, messages: images(2, black) }, 400, 'messages[0].content[1].image_url.url'],
    ['image tokens typed into the text', { ...ok, messages: [{ role: 'user', content: 'see <|vision_start|><|image_pad|><|vision_end|>' }] }, 400, 'messages'],
    ['a video token typed into the text', { ...ok, messages: [{ role: 'user', content: 'hi <|video_pad|>' }] }, 400, 'messages'],
    ['frequency_penalty 0.5 (not applied by vlmgen)', { ...ok, frequency_penalty: 0.5 }, 400, 'frequency_penalty'],
    ['presence_penalty a string', { ...ok, presence_penalty: 'x' }, 400, 'presence_penalty'],
    ['max_tokens a string beside max_completion_tokens', { ...ok, max_completion_tokens: 3, max_tokens: 'abc' }, 400, 'max_tokens'],
    ['a body that is not UTF-8', Buffer.from('{"messages":[{"role":"user","content":"\xff"}]}', 'latin1'), 400, null],
    ['a role cut inside a character', { messages: [{ role: '日本語日本語日本語日本語', content: 'hi' }] }, 400, 'messages[0].role'],
    ['a gzip-encoded body', ok, 415, null, { headers: { 'Content-Encoding': 'gzip' } }],
    ['a form body', ok, 415, null, { headers: { 'Content-Type': 'application/x-www-form-urlencoded' } }],
    ['max_tokens above 2^63', '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":18446744073709551615}', 400, 'max_tokens', undefined, '18446744073709551615'],
    ['top_p 0', { ...ok, top_p: 0 }, 400, 'top_p', undefined, '[1e-09, 1]'],
    ['n = 2', { ...ok, n: 2 }, 400, 'n'],
    ['max_tokens 0', { ...ok, max_tokens: 0 }, 400, 'max_tokens'],
    ['max_tokens a string', { ...ok, max_tokens: 'ten' }, 400, 'max_tokens'],
    ['temperature 3', { ...ok, temperature: 3 }, 400, 'temperature'],
    ['five stop strings', { ...ok, stop: ['a', 'b', 'c', 'd', 'e'] }, 400, 'stop'],
    ['a prompt longer than the context', { ...ok, max_tokens: 100000 }, 400, 'messages'],
    ['stream_options without stream', { ...ok, stream_options: { include_usage: true } }, 400, 'stream_options'],
    ['top_logprobs without logprobs', { ...ok, top_logprobs: 2 }, 400, 'top_logprobs'],
    ['tools', { ...ok, tools: [] }, 400, 'tools'],
    ['a body over --max-body-bytes', JSON.stringify({ ...ok, pad: 'x'.repeat(3 << 20) }), 413, null],
    ['no API key', ok, 401, null, { headers: { Authorization: '' } }],
    ['a wrong API key', ok, 401, null, { headers: { Authorization: 'Bearer nope' } }],
  ];
  for (const [what, body, status, param, extra, says] of bad) {
    const res = await post(body, extra);
    check(res.status === status, `${what}: status ${status}`, res);
    check(res.body && res.body.error && typeof res.body.error.message === 'string' && res.body.error.type,
          `${what}: an OpenAI error object`, res.body);
    if (param !== null) check(res.body.error.param === param, `${what}: names ${param}`, res.body.error);
    if (says !== undefined) check(res.body.error.message.includes(says), `${what}: says ${says}`, res.body.error);
  }
  const unsized = await chunked('/v1/chat/completions', JSON.stringify(ok));
  check(unsized.status === 411 && unsized.body.error, 'a chunked body (no Content-Length): 411 before it is read', unsized);
  const head = `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${apiKey}\r\nContent-Type: application/json\r\n`;
  check(await rawStatus(head + 'Transfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n') === 411,
        'chunked with a Content-Length beside it: 411');
  check(await rawStatus(head + '\r\n{"messages":') === 411, 'a body without any length: 411');
  check(await rawStatus('PUT /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n') === 405,
        'a PUT, no key needed off /v1 (its body the HTTP library would read whole): 405 before it is read');
  const health = await raw('/health', { method: 'GET', headers: { 'Content-Encoding': 'gzip' } });
  check(health.status === 200, 'GET /health with a Content-Encoding header: 200 (no body is read)', health);
  const typed = await post(ok, { headers: { 'Content-Type': 'Application/JSON; charset=utf-8' } });
  check(typed.status === 200, 'Content-Type Application/JSON; charset=utf-8 is JSON', typed);
  const unknown = await raw('/v1/nothing', { method: 'GET' });
  check(unknown.status === 404 && unknown.body.error, 'unknown path: 404 with an error object', unknown);
  const again = await client.chat.completions.create(greedy);
  check(again.choices[0].message.content === expected.text, 'still serving correct answers after bad requests');
  console.log(`OK ${bad.length + 5} bad requests answered with their status and field; still serving`);

  // Sampling without a seed differs from request to request (with one it repeats); each reply's
  // 'created' is its own time.
  const sampled = { model: 'm', messages: [{ role: 'user', content: 'Hi' }], max_tokens: 12, temperature: 1.5 };
  const first = await client.chat.completions.create(sampled);
  await new Promise((res) => setTimeout(res, 1100));
  const second = await client.chat.completions.create(sampled);
  check(first.choices[0].message.content !== second.choices[0].message.content, 'no seed: two different samples',
        [first.choices[0].message.content, second.choices[0].message.content]);
  check(second.created > first.created, 'created: each reply\'s own time', [first.created, second.created]);
  const seeded = await Promise.all([1, 2].map(() => client.chat.completions.create({ ...sampled, seed: 7 })));
  check(seeded[0].choices[0].message.content === seeded[1].choices[0].message.content, 'seed 7 twice: the same sample');
  console.log('OK seeds: none samples afresh, one repeats; created per reply');

  // No max_tokens near the end of the context: the default is cut to the context left.
  const near = await client.chat.completions.create({ model: 'm', temperature: 0,
                                                      messages: [{ role: 'user', content: ' word'.repeat(1900) }] });
  const left = 2048 - near.usage.prompt_tokens;
  check(near.usage.prompt_tokens > 2048 - 256 && left > 0 && near.usage.completion_tokens <= left &&
        (near.usage.completion_tokens === left) === (near.choices[0].finish_reason === 'length'),
        'no max_tokens, a prompt within 256 tokens of the context: served up to the context', near.usage);
  console.log('OK default max_tokens: ' + JSON.stringify(near.usage) + ' ' + near.choices[0].finish_reason);

  // 7. A streaming client that goes away after 3 chunks: the request is cancelled, KV returns.
  const before499 = await statusCount(499);
  const long = await client.chat.completions.create({ ...greedy, max_tokens: 1500, stream: true });
  let seen = 0;
  for await (const chunk of long) {
    if (++seen === 3) { long.controller.abort(); break; }
  }
  let freed = false;
  for (let i = 0; i < 200 && !freed; i++) {
    await new Promise((res) => setTimeout(res, 50));
    freed = (await statusCount(499)) === before499 + 1 && (await metric('vlmgen_kv_cache_bytes_used')) === 0 &&
            (await metric('vlmgen_kv_blocks_used')) === 0 && (await metric('vlmgen_requests_running')) === 0;
  }
  check(freed, 'the abandoned stream was cancelled and its KV cache freed', { kv: await metric('vlmgen_kv_cache_bytes_used') });
  console.log('OK disconnect: cancelled, KV cache back to 0');
  console.log(`all ${checks} checks passed`);
}

// Limits mode (a server with --max-running 1 --max-waiting 1 --allow-local-images DIR, DIR holding
// IMAGE.png as picture.png): local paths inside DIR only, and 429 with Retry-After on a full queue.
async function limits() {
  const dir = process.env.VLMGEN_SERVE_IMAGE_DIR;
  const withUrl = (u) => [{ role: 'user', content: [{ type: 'image_url', image_url: { url: u } },
                                                    { type: 'text', text: 'Describe this image.' }] }];
  const base = { model: 'm', max_tokens: expected.max_tokens, temperature: 0 };
  for (const u of [dir + '/picture.png', 'file://' + dir + '/picture.png', dir + '/../images/picture.png']) {
    const r = await client.chat.completions.create({ ...base, messages: withUrl(u) });
    check(r.choices[0].message.content === expected.text, `a local path inside the folder (${u}) reads the picture`,
          r.choices[0].message.content);
  }
  const post = (body) => raw('/v1/chat/completions', { method: 'POST', body: JSON.stringify(body) });
  for (const u of [dir + '/../expected.json', '/etc/passwd', dir + '/missing.png', 'file:///etc/hostname']) {
    const r = await post({ ...base, messages: withUrl(u) });
    check(r.status === 400 && r.body.error.param === 'messages[0].content[0].image_url.url',
          `a path outside the folder or missing (${u}) is a 400`, r);
  }
  console.log('OK --allow-local-images: inside read, outside refused');

  // One running, one waiting: the third is refused with 429 and Retry-After.
  const long = { ...base, messages: withUrl(imageUrl), max_tokens: 1500, stream: true };
  const first = await client.chat.completions.create(long);
  const firstIt = first[Symbol.asyncIterator]();
  await firstIt.next();
  const second = await client.chat.completions.create(long);
  const secondIt = second[Symbol.asyncIterator]();
  await secondIt.next();
  const third = await post({ ...base, messages: withUrl(imageUrl) });
  check(third.status === 429 && third.headers.get('retry-after') === '1' && third.body.error.type === 'rate_limit_error',
        'a full queue answers 429 with Retry-After', { status: third.status, body: third.body });
  // The queued stream's client leaves: the keep-alive comments (--keep-alive-seconds 0.1) find it
  // gone, and it leaves the queue while the first still runs (its 1500 tokens take seconds).
  const queued499 = await statusCount(499);
  second.controller.abort();
  let left = false;
  for (let i = 0; i < 40 && !left; i++) {
    await new Promise((res) => setTimeout(res, 50));
    left = (await metric('vlmgen_requests_waiting')) === 0 && (await statusCount(499)) === queued499 + 1;
  }
  check(left && (await metric('vlmgen_requests_running')) === 1,
        'an abandoned queued stream leaves the queue while the running one goes on',
        { waiting: await metric('vlmgen_requests_waiting'), running: await metric('vlmgen_requests_running') });
  first.controller.abort();
  let idle = false;
  for (let i = 0; i < 200 && !idle; i++) {
    await new Promise((res) => setTimeout(res, 50));
    idle = (await metric('vlmgen_requests_running')) === 0 && (await metric('vlmgen_requests_waiting')) === 0;
  }
  check(idle, 'the aborted streams leave nothing running or waiting');
  const after = await client.chat.completions.create({ ...base, messages: withUrl(imageUrl) });
  check(after.choices[0].message.content === expected.text, 'served again once the queue emptied');
  console.log('OK queue full: 429 with Retry-After; served again afterwards');
  console.log(`all ${checks} limit checks passed`);
}

// Slots mode (a server with --threads 5: one connection may generate, four stay free): a second
// request while a stream runs is a 429, and /health still answers at once.
async function slots() {
  const base = { model: 'm', messages: imageMessages, temperature: 0 };
  const stream = await client.chat.completions.create({ ...base, max_tokens: 1500, stream: true });
  const it = stream[Symbol.asyncIterator]();
  await it.next();
  const busy = await raw('/v1/chat/completions', { method: 'POST', body: JSON.stringify({ ...base, max_tokens: 2 }) });
  check(busy.status === 429 && busy.headers.get('retry-after') === '1' && busy.body.error.code === 'connections_busy',
        'every generating connection busy: 429 with Retry-After', { status: busy.status, body: busy.body });
  const started = Date.now();
  check((await raw('/health', { method: 'GET' })).status === 200 && Date.now() - started < 2000,
        '/health answers while the stream runs', Date.now() - started);
  stream.controller.abort();
  let served = null;
  for (let i = 0; i < 100 && served === null; i++) {
    await new Promise((res) => setTimeout(res, 50));
    const r = await raw('/v1/chat/completions', { method: 'POST', body: JSON.stringify({ ...base, max_tokens: expected.max_tokens }) });
    if (r.status === 200) served = r.body;
  }
  check(served !== null && served.choices[0].message.content === expected.text, 'served again once the stream ended');
  console.log(`OK connections: 429 while busy, /health free, served again (${checks} checks)`);
}

// Cut mode (a server with --grace-seconds 0, sent SIGTERM once this says "2 requests open"): a
// reply and a stream the shutdown cancels end as errors (503, shutting_down), not as finished.
async function cut() {
  const body = (stream) => JSON.stringify({ model: 'm', messages: [{ role: 'user', content: 'Hi' }], max_tokens: 1900,
                                            temperature: 0, stream });
  const headers = { 'Content-Type': 'application/json', Authorization: 'Bearer ' + apiKey };
  const whole = fetch(url + '/v1/chat/completions', { method: 'POST', headers, body: body(false) });
  const streamed = await fetch(url + '/v1/chat/completions', { method: 'POST', headers, body: body(true) });
  const reader = streamed.body.getReader();
  let text = new TextDecoder().decode((await reader.read()).value);
  for (let i = 0; i < 200 && (await metric('vlmgen_requests_running')) < 2; i++) {
    await new Promise((res) => setTimeout(res, 20));
  }
  check((await metric('vlmgen_requests_running')) === 2, 'both requests running before the signal');
  console.log('2 requests open');
  for (let r = await reader.read(); !r.done; r = await reader.read()) text += new TextDecoder().decode(r.value);
  const reply = await whole;
  const replyBody = await reply.json();
  const cutSays = 'shut down before the reply was complete';
  check(reply.status === 503 && replyBody.error && replyBody.error.code === 'shutting_down' &&
        replyBody.error.message.includes(cutSays), 'a reply the shutdown cut: 503 shutting_down', { status: reply.status, body: replyBody });
  check(text.includes('"code":"shutting_down"') && text.includes(cutSays) && !text.includes('"finish_reason":"stop"') &&
        !text.includes('"finish_reason":"length"') && text.trim().endsWith('data: [DONE]'),
        'a stream the shutdown cut: an error event, no finish_reason, then [DONE]', text.slice(-400));
  console.log(`OK cut by shutdown: 503 reply, error event in the stream (${checks} checks)`);
}

// Shutdown mode: open 8 streams, say so, and read them to their end.
async function hold() {
  const streams = [];
  for (let i = 0; i < 8; i++) {
    streams.push(client.chat.completions.create({ model: 'm', messages: imageMessages, max_tokens: 64, temperature: 0, stream: true }));
  }
  const opened = await Promise.all(streams);
  const firsts = opened.map((s) => s[Symbol.asyncIterator]());
  await Promise.all(firsts.map((it) => it.next()));
  console.log('8 streams open');
  let finished = 0;
  await Promise.all(firsts.map(async (it) => {
    try {
      for (let r = await it.next(); !r.done; r = await it.next()) {
        if (r.value.choices.some((c) => c.finish_reason)) finished++;
      }
    } catch (e) {
      console.log('a stream failed: ' + e);
    }
  }));
  console.log(`${finished} of 8 streams finished`);
}

(process.env.VLMGEN_SERVE_HOLD ? hold() : process.env.VLMGEN_SERVE_SLOTS ? slots() : process.env.VLMGEN_SERVE_CUT ? cut()
  : process.env.VLMGEN_SERVE_IMAGE_DIR ? limits() : main()).catch((e) => { console.error('FAIL: ' + (e.stack || e)); process.exit(1); });
