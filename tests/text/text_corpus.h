// Deterministic test text for the tokenizer tests: strings that exercise every branch of Qwen's
// pre-tokenizer regex, NFC normalization, byte-level BPE and added-token matching, and larger
// corpora for benchmarks. Header-only, standard library only; the same seed gives the same bytes
// on every platform and standard library (own PRNG, no std:: distributions).
//
// Every string is valid UTF-8. Characters on which JavaScript and PCRE2 disagree about \s, \p{L}
// or \p{N} (U+0085, U+180E, U+FEFF, U+200B), code points assigned after Unicode 14 and
// unassigned ones are left out, so that the reference (Node) and vlmgen (PCRE2, utf8proc) must
// agree exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vlmgen::testing_text {

namespace detail {

/// splitmix64: tiny, fast, and fully specified, so output is identical everywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  /// Uniform-ish in [0, n) (modulo bias is irrelevant here); n must be > 0.
  size_t below(size_t n) { return static_cast<size_t>(next() % n); }
  /// Uniform-ish in [lo, hi].
  size_t between(size_t lo, size_t hi) { return lo + below(hi - lo + 1); }
  /// True with probability percent/100.
  bool chance(unsigned percent) { return below(100) < percent; }
  template <typename T, size_t N>
  const T& pick(const T (&a)[N]) {
    return a[below(N)];
  }

 private:
  uint64_t state_;
};

// ---- Word and phrase lists (real text, so BPE sees realistic merges) ----

inline const char* const kEnglishWords[] = {
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "with",
    "as",
    "was",
    "on",
    "be",
    "at",
    "by",
    "this",
    "had",
    "not",
    "are",
    "but",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "her",
    "all",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "image",
    "picture",
    "model",
    "token",
    "vision",
    "language",
    "describe",
    "question",
    "answer",
    "camera",
    "window",
    "kitchen",
    "mountain",
    "river",
    "yellow",
    "bicycle",
    "umbrella",
    "photograph",
    "background",
    "foreground",
    "tokenizer",
    "transformer",
    "attention",
    "sequence",
    "gradient",
    "probability",
    "encoding",
    "Wednesday",
    "London",
    "Paris",
    "Einstein",
    "Python",
    "GitHub",
    "OpenAI",
    "Qwen",
    "internationalization",
    "unbelievable",
    "extraordinarily",
    "antidisestablishmentarianism",
};

inline const char* const kEnglishSentences[] = {
    "The quick brown fox jumps over the lazy dog.",
    "A picture is worth a thousand words, but a caption needs only a few.",
    "Describe the image in one sentence.",
    "What color is the car parked next to the red brick building?",
    "There are three cats sleeping on the windowsill, and one dog watching them.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon.",
    "The model was trained on 1.4 trillion tokens over 21 days.",
    "Please answer with \"yes\" or \"no\" only.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "It was the best of times, it was the worst of times.",
    "To be, or not to be: that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "The meeting has been moved to Thursday at 3:30 p.m. (room 4B).",
    "Mr. O'Brien's dog didn't bark at the mailman's van.",
    "Wait... what?! That can't be right.",
    "The tokenizer splits text into pieces, then merges byte pairs by rank.",
    "Temperatures reached 38.5 degrees Celsius on the 14th of July.",
    "Call me Ishmael.",
    "A man, a plan, a canal: Panama!",
    "Is this the real life? Is this just fantasy?",
    "The invoice total is $1,234.56, due by 2024-03-31.",
    "He said, 'We'll see,' and left without another word.",
    "Most birds can fly, but penguins and ostriches cannot.",
    "The photograph shows a narrow street lined with cafes and bicycles.",
    "Read the instructions carefully before you begin.",
};

// Contractions; the pre-tokenizer matches 's 't 're 've 'm 'll 'd case-insensitively.
inline const char* const kContractions[] = {
    "I'm",
    "you'll",
    "don't",
    "it's",
    "we've",
    "they're",
    "he'd",
    "she's",
    "can't",
    "won't",
    "isn't",
    "that's",
    "let's",
    "you'd",
    "we'll",
    "I've",
    "they'd",
    "John's",
    "o'clock",
    "rock 'n' roll",
    "y'all",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "''s",
    "'ss",
    "'LLama",
    "I'M",
    "YOU'LL",
    "DON'T",
    "IT'S",
    "WE'VE",
    "THEY'RE",
    "HE'D",
    "CAN'T",
    "'S",
    "'T",
    "'RE",
    "'VE",
    "'M",
    "'LL",
    "'D",
    "'Ll",
    "'lL",
    "'rE",
    "'Re",
    "'vE",
    "'Ve",
    "O'NEIL'S",
    "I'M SURE YOU'LL LIKE IT, DON'T YOU?",
    "WE'D'VE",
    "it's'",
    "don\xE2\x80\x99t",
};

inline const char* const kChinese[] = {
    "你好，世界！",
    "今天天气很好。",
    "这张图片里有一只猫。",
    "请描述这幅图像。",
    "我们正在学习机器学习。",
    "北京是中国的首都",
    "人工智能",
    "自然语言处理",
    "视觉语言模型",
    "一只黄色的狗在草地上奔跑",
    "他说：“明天见。”",
    "图中有三个人。",
    "中华人民共和国",
    "谢谢你的帮助！",
    "这是一个测试句子。",
    "春眠不觉晓，处处闻啼鸟。",
    "「引号」和『书名号』",
    "上海浦东新区",
    "计算机视觉",
    "问：这是什么？答：苹果。",
    "繁體中文也要測試",
    "龍鳳呈祥",
    "的",
    "了",
    "是",
};

inline const char* const kJapanese[] = {
    "こんにちは",
    "ありがとうございます",
    "日本語のテキスト",
    "東京タワーは赤いです。",
    "写真に猫が写っています。",
    "カタカナ",
    "コンピューター",
    "ひらがなとカタカナと漢字",
    "今日はいい天気ですね。",
    "すみません、駅はどこですか？",
    "吾輩は猫である。名前はまだ無い。",
    "ラーメンを食べました",
    "人々",
    "ｶﾀｶﾅ",
    "富士山",
    "東京都渋谷区",
    "おはようございます！",
    "この画像を説明してください。",
};

inline const char* const kKorean[] = {
    "안녕하세요",
    "감사합니다",
    "한국어 텍스트",
    "서울은 대한민국의 수도입니다.",
    "이 사진에는 고양이가 있습니다.",
    "사랑해요",
    "좋은 아침입니다!",
    "무엇을 도와드릴까요?",
    "인공지능",
    "대한민국",
    "컴퓨터 비전",
    "이미지를 설명해 주세요.",
    "괜찮아요",
    "한글",
};

inline const char* const kArabic[] = {
    "مرحبا بالعالم",    "السلام عليكم",  "شكرا جزيلا",  "اللغة العربية",   "هذه صورة لقطة.", "كيف حالك؟",
    "الذكاء الاصطناعي", "مدينة القاهرة", "في عام ٢٠٢٤", "كتاب، قلم، ورقة", "بِسْمِ اللَّهِ",       "صباح الخير",
};

inline const char* const kCyrillic[] = {
    "Привет, мир!",
    "Спасибо",
    "Москва — столица России.",
    "На фотографии изображена кошка.",
    "Добрый день",
    "искусственный интеллект",
    "Опишите изображение.",
    "Ёлка",
    "съешь же ещё этих мягких французских булок",
    "Україна",
    "Київ",
    "Здравствуйте!",
    "ПРОГРАММИРОВАНИЕ",
    "Беларусь",
    "Србија",
};

inline const char* const kGreek[] = {
    "Γειά σου κόσμε",           "Ευχαριστώ", "Αθήνα",    "ελληνικά",
    "Η γρήγορη καφέ αλεπού",    "φιλοσοφία", "ΑΛΦΑΒΗΤΟ", "Καλημέρα!",
    "αβγδεζηθικλμνξοπρστυφχψω", "Σωκράτης",  "ΐΰ",
};

inline const char* const kHindi[] = {
    "नमस्ते",
    "धन्यवाद",
    "हिन्दी भाषा",
    "भारत की राजधानी नई दिल्ली है।",
    "इस चित्र में एक बिल्ली है।",
    "कृत्रिम बुद्धिमत्ता",
    "आप कैसे हैं?",
    "शुभ प्रभात",
    "मुंबई",
    "क्षत्रिय",
    "२०२४",
};

inline const char* const kThai[] = {
    "สวัสดีครับ", "ขอบคุณมาก", "ภาษาไทย", "กรุงเทพมหานคร", "ในภาพมีแมวหนึ่งตัว", "ปัญญาประดิษฐ์", "สบายดีไหม", "น้ำ", "๑๒๓",
};

inline const char* const kEmoji[] = {
    "😀",
    "😂",
    "🙂",
    "🤔",
    "👍",
    "👍🏽",
    "👋🏻",
    "🙏🏿",
    "🔥",
    "🎉",
    "🚀",
    "❤️",
    "✅",
    "⚠️",
    "☕",
    "🐍",
    "🦀",
    "🌍",
    "🍣",
    "🇯🇵",
    "🇺🇸",
    "1️⃣",
    "©️",
    "™",
    "\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466",  // family: man, woman, girl, boy
    "\U0001F3F3\uFE0F\u200D\U0001F308",                            // rainbow flag
    "\U0001F469\U0001F3FE\u200D\U0001F4BB",                        // woman technologist, skin tone
    "\U0001F469\u200D\U0001F52C",                                  // woman scientist
    "\U0001F937\u200D\u2640\uFE0F",                                // woman shrugging
    "\U0001F9D1\u200D\U0001F91D\u200D\U0001F9D1",                  // people holding hands
    "😀😀😀",
    "🎉🎉",
    "👍🏽👍🏽",
};

// NFC changes every one of these (composition, canonical reordering, singletons, exclusions).
inline const char* const kCombining[] = {
    "e\u0301",
    "a\u0308",
    "o\u0302",
    "n\u0303",
    "A\u030A",
    "u\u0308ber",
    "cafe\u0301",
    "na\u0308ive",
    "Zu\u0308rich",
    "Cre\u0300me bru\u0302le\u0301e",
    "Se\u0301bastien",
    "e\u0301\u0301",
    "a\u0323\u0302",
    "a\u0302\u0323",
    "q\u0307\u0323",
    "\u1100\u1161\u11A8",                    // Hangul jamo of U+AC01
    "\u1112\u1161\u11AB\u1100\u1173\u11AF",  // jamo of the word Hangul
    "\u212B",                                // ANGSTROM SIGN -> U+00C5
    "\u2126",                                // OHM SIGN -> U+03A9
    "\u037E",                                // GREEK QUESTION MARK -> ';'
    "\u0387",                                // GREEK ANO TELEIA -> U+00B7
    "\u0958",                                // DEVANAGARI QA: composition exclusion, NFC decomposes it
    "\uF900",                                // CJK COMPATIBILITY IDEOGRAPH -> U+8C48
    "\u0301",                                // lone combining mark
    "\u00E9",
    "\u00C5",
    "\uFB01le",  // already NFC (and U+FB01 'fi' ligature stays: NFC, not NFKC)
};

inline const char* const kWhitespace[] = {
    " ",      "  ",     "   ",    "        ", "\t",     "\t\t",     "\r\n",   "\n", "\n\n",
    "\n\n\n", " \n",    "\n ",    "  \n  ",   "\r",     "\r\n\r\n", " \t \n", "\f", "\v",
    "\u00A0", "\u3000", "\u2003", "\u202F",   "\u2028", "   \t",    "\n    ",
};

inline const char* const kNumbers[] = {
    "0",         "7",
    "42",        "365",
    "2024",      "3.14159",
    "1,000,000", "2024-06-01",
    "12:45:07",  "12345678901234567890",
    "0x1F",      "1e-9",
    "-273.15",   "+49 30 1234567",
    "100%",      "v2.1.0",
    "１２３",    "٠١٢٣٤٥",
    "²",         "½",
    "Ⅻ",         "3rd",
    "4th",       "99.9%",
    "007",
};

inline const char* const kCode[] = {
    "int main() {\n    return 0;\n}\n",
    "#include <iostream>\n",
    "for (size_t i = 0; i < n; ++i) sum += v[i];",
    "std::vector<int> v{1, 2, 3};",
    "if (a && b || !c) { x->y = *p; }",
    "template <typename T>\nT max(T a, T b) { return a > b ? a : b; }\n",
    "auto it = m.find(\"key\");\nif (it != m.end()) std::cout << it->second << '\\n';",
    "def f(x):\n    if x > 0:\n        return x ** 2\n    return -x\n",
    "class Foo:\n    def __init__(self):\n        self.items = []\n",
    "x = [i * 2 for i in range(10)]",
    "    # indented comment\n",
    "print(f\"{name!r}: {value:.2f}\")",
    "import numpy as np\nimport torch\n",
    "{\"name\": \"vlmgen\", \"version\": 1, \"tags\": [\"a\", \"b\"]}",
    "$ ls -la | grep '.txt' > out.log 2>&1",
    "SELECT id, name FROM users WHERE age >= 18;",
    "\tif (x) {\n\t\ty();\n\t}\n",
    "<div class=\"box\">Hello</div>",
    "a+=1;b-=2;c*=3;d/=4;",
};

inline const char* const kUrls[] = {
    "https://github.com/QwenLM/Qwen2-VL",
    "http://example.com/path?q=1&r=two#frag",
    "user.name+tag@example.co.uk",
    "ftp://files.example.org/pub/",
    "mailto:someone@example.com",
    "www.wikipedia.org/wiki/Tokenization",
    "https://huggingface.co/Qwen/Qwen2-VL-2B-Instruct",
    "admin@localhost",
    "http://192.168.0.1:8080/",
    "file:///home/user/image.png",
};

inline const char* const kPunctuation[] = {
    "...", "!!!", "?!",      "---", "***",  "«", "»",  "“quoted”", "‘single’", "—",  "…",  "(!)", "[[]]", "{}",
    "<>",  "~~~", "@#$%^&*", "''",  "\"\"", ".", ",",  ";",        ":",        "!?", "¿",  "¡",   "§",    "°",
    "→",   "•",   "、",      "。",  "！",   "|", "\\", "/",        "_",        "=",  "==", "=>",  "::",   "`",
};

inline const char* const kSpecialTokens[] = {
    "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|endoftext|>",
};

// Near misses: must be encoded as ordinary text.
inline const char* const kNearSpecial[] = {
    "<|im_start|", "<|im_start", "|im_end|>", "<|IM_START|>", "<||>",
    "<|unknown|>", "<|",         "|>",        "< |im_end|>",  "<|image_pad |>",
};

enum Category : size_t {
  kEnglish,
  kContraction,
  kZh,
  kJa,
  kKo,
  kAr,
  kRu,
  kEl,
  kHi,
  kTh,
  kEmo,
  kComb,
  kWs,
  kNum,
  kCodeCat,
  kUrl,
  kPunct,
  kSpecial,
  kCategoryCount
};

inline std::string english_sentence(Rng& rng) {
  if (rng.chance(50)) return rng.pick(kEnglishSentences);
  size_t n = rng.between(3, 14);
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    std::string w = rng.pick(kEnglishWords);
    if (i == 0 && w[0] >= 'a' && w[0] <= 'z') w[0] = static_cast<char>(w[0] - 'a' + 'A');
    if (i) s += rng.chance(8) ? ", " : " ";
    s += w;
  }
  static const char* const kEnds[] = {".", ".", ".", "?", "!", ":", "...", ";"};
  return s + rng.pick(kEnds);
}

inline std::string english_paragraph(Rng& rng) {
  std::string p;
  size_t n = rng.between(2, 7);
  for (size_t i = 0; i < n; ++i) {
    if (i) p += ' ';
    p += english_sentence(rng);
  }
  return p;
}

// Changes the case of ASCII letters: unchanged, lower, upper, or random per letter.
inline std::string recase(Rng& rng, std::string s) {
  size_t mode = rng.below(4);
  for (char& c : s) {
    bool lower = c >= 'a' && c <= 'z', upper = c >= 'A' && c <= 'Z';
    if (!lower && !upper) continue;
    bool to_upper = mode == 2 || (mode == 3 && rng.chance(50));
    if (mode == 0) continue;
    if (to_upper && lower) c = static_cast<char>(c - 'a' + 'A');
    if (!to_upper && upper) c = static_cast<char>(c - 'A' + 'a');
  }
  return s;
}

inline std::string pick_n(Rng& rng, const char* const* list, size_t size, size_t n, const char* sep) {
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    if (i) s += sep;
    s += list[rng.below(size)];
  }
  return s;
}

#define VLMGEN_TT_PICK_N(list, n, sep) pick_n(rng, list, sizeof(list) / sizeof(list[0]), (n), (sep))

/// One fragment of the given category (valid UTF-8, at most a few hundred bytes).
inline std::string fragment(Rng& rng, size_t cat) {
  switch (cat) {
    case kEnglish:
      switch (rng.below(3)) {
        case 0: return rng.pick(kEnglishWords);
        case 1: return english_sentence(rng);
        default: return VLMGEN_TT_PICK_N(kEnglishWords, rng.between(2, 5), " ");
      }
    case kContraction: {
      std::string c = rng.pick(kContractions);
      if (rng.chance(40)) c = recase(rng, c);
      if (rng.chance(30)) c = std::string(rng.pick(kEnglishWords)) + c;
      return c;
    }
    case kZh: return VLMGEN_TT_PICK_N(kChinese, rng.between(1, 3), rng.chance(50) ? "" : "，");
    case kJa: return VLMGEN_TT_PICK_N(kJapanese, rng.between(1, 3), rng.chance(50) ? "" : "、");
    case kKo: return VLMGEN_TT_PICK_N(kKorean, rng.between(1, 3), " ");
    case kAr: return VLMGEN_TT_PICK_N(kArabic, rng.between(1, 3), " ");
    case kRu: return VLMGEN_TT_PICK_N(kCyrillic, rng.between(1, 3), " ");
    case kEl: return VLMGEN_TT_PICK_N(kGreek, rng.between(1, 3), " ");
    case kHi: return VLMGEN_TT_PICK_N(kHindi, rng.between(1, 3), " ");
    case kTh: return VLMGEN_TT_PICK_N(kThai, rng.between(1, 3), rng.chance(50) ? "" : " ");
    case kEmo: return VLMGEN_TT_PICK_N(kEmoji, rng.between(1, 4), rng.chance(60) ? "" : " ");
    case kComb: {
      std::string s = rng.pick(kCombining);
      if (rng.chance(30)) s = std::string(rng.pick(kEnglishWords)) + s;
      if (rng.chance(30)) s += rng.pick(kEnglishWords);
      return s;
    }
    case kWs: {
      std::string s = rng.pick(kWhitespace);
      if (rng.chance(30)) s += rng.pick(kWhitespace);
      return s;
    }
    case kNum: {
      if (rng.chance(15)) {  // a long digit run
        std::string s;
        size_t n = rng.between(5, 60);
        for (size_t i = 0; i < n; ++i) s += static_cast<char>('0' + rng.below(10));
        return s;
      }
      return rng.pick(kNumbers);
    }
    case kCodeCat: return rng.pick(kCode);
    case kUrl: return rng.pick(kUrls);
    case kPunct: return VLMGEN_TT_PICK_N(kPunctuation, rng.between(1, 3), "");
    case kSpecial: {
      switch (rng.below(6)) {
        case 0: return rng.pick(kNearSpecial);
        case 1: return "<|vision_start|><|image_pad|><|vision_end|>";
        case 2: {
          std::string s = "<|vision_start|>";
          for (size_t i = rng.between(2, 6); i > 0; --i) s += "<|image_pad|>";
          return s + "<|vision_end|>";
        }
        case 3: return std::string("<|im_start|>user\n") + english_sentence(rng) + "<|im_end|>\n";
        default: return rng.pick(kSpecialTokens);
      }
    }
  }
  return std::string();
}

#undef VLMGEN_TT_PICK_N

inline std::string separator(Rng& rng) {
  static const char* const kSeps[] = {"",   "",   "",   " ",  " ",  " ",   " ",    " ",
                                      "\n", ", ", ". ", "  ", "\t", " - ", "\n\n", "："};
  return rng.pick(kSeps);
}

inline bool is_continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

}  // namespace detail

/// `count` deterministic, valid UTF-8 test strings for tokenizer parity tests. String 0 is the
/// empty string; string i > 0 mostly draws its 1..12 fragments from category (i-1) mod 18
/// (English, contractions, Chinese, Japanese, Korean, Arabic, Cyrillic, Greek, Hindi, Thai,
/// emoji, combining/NFC cases, whitespace runs, numbers, code, URLs/e-mail, punctuation, added
/// tokens), the rest from any category, joined by random separators (often none). Strings of
/// the added-token category also get special tokens inserted at random character boundaries.
/// Lengths are 0..~400 bytes; about 1% run to ~4000 bytes.
inline std::vector<std::string> tokenizer_test_strings(uint64_t seed, size_t count) {
  using namespace detail;
  std::vector<std::string> out;
  out.reserve(count);
  Rng rng(seed ^ 0x746F6B656E697A65ULL);
  for (size_t i = 0; i < count; ++i) {
    if (i == 0) {
      out.emplace_back();
      continue;
    }
    const size_t primary = (i - 1) % kCategoryCount;
    const bool long_string = rng.chance(1);
    const size_t max_len = long_string ? rng.between(1000, 4000) : rng.between(1, 400);
    const size_t fragments = long_string ? 1000 : rng.between(1, 12);
    std::string s;
    size_t misses = 0;
    for (size_t f = 0; f < fragments && misses < 8; ++f) {
      size_t cat = rng.chance(60) ? primary : rng.below(kCategoryCount);
      std::string piece = (f ? separator(rng) : std::string()) + fragment(rng, cat);
      if (s.size() + piece.size() > max_len && !(s.empty() && piece.size() <= 400)) {
        ++misses;
        continue;
      }
      s += piece;
    }
    if (primary == kSpecial) {  // special tokens inside words, between \r and \n, ...
      for (size_t k = rng.below(3); k > 0 && !s.empty(); --k) {
        size_t at = rng.below(s.size() + 1);
        while (at < s.size() && is_continuation(static_cast<unsigned char>(s[at]))) ++at;
        s.insert(at, rng.pick(kSpecialTokens));
      }
    }
    if (rng.chance(5)) s += rng.chance(50) ? " " : "   ";  // trailing spaces
    out.push_back(std::move(s));
  }
  return out;
}

namespace detail {

inline std::string other_paragraph(Rng& rng, size_t cat) {
  std::string p;
  if (cat == kCodeCat) {
    for (size_t n = rng.between(1, 3); n > 0; --n) p += fragment(rng, kCodeCat);
    while (!p.empty() && p.back() == '\n') p.pop_back();
    return p;
  }
  for (size_t n = rng.between(3, 10); n > 0; --n) {
    if (!p.empty()) {
      if (cat == kZh || cat == kJa)
        p += rng.chance(50) ? "" : "。";
      else
        p += rng.chance(85) ? " " : ", ";
    }
    if (rng.chance(15)) p += english_sentence(rng) + " ";
    p += fragment(rng, cat);
  }
  return p;
}

// Appends paragraphs from next_paragraph until ~bytes, then cuts at a character boundary.
template <typename F>
std::string build_corpus(size_t bytes, F&& next_paragraph) {
  std::string out;
  out.reserve(bytes + 4096);
  while (out.size() < bytes) {
    out += next_paragraph();
    out += '\n';
  }
  size_t cut = bytes;
  while (cut > 0 && cut < out.size() && is_continuation(static_cast<unsigned char>(out[cut]))) --cut;
  out.resize(cut);
  return out;
}

}  // namespace detail

/// About `bytes` bytes (never more, at most 3 fewer) of '\n'-separated paragraphs for
/// benchmarks: ~60% English prose, the rest Chinese, Japanese, Korean, Arabic, Cyrillic, Greek,
/// Hindi, Thai, emoji, NFC cases, numbers, code, URLs and punctuation. Valid UTF-8 (cut at a
/// character boundary); no added tokens.
inline std::string mixed_corpus(size_t bytes, uint64_t seed) {
  using namespace detail;
  Rng rng(seed ^ 0x6D69786564636F72ULL);
  static const size_t kOthers[] = {kContraction, kZh,  kJa,   kKo,  kAr,      kRu,  kEl,   kHi,
                                   kTh,          kEmo, kComb, kNum, kCodeCat, kUrl, kPunct};
  return build_corpus(bytes, [&] {
    if (rng.chance(60)) return english_paragraph(rng);
    return other_paragraph(rng, rng.pick(kOthers));
  });
}

/// About `bytes` bytes (never more, at most 3 fewer) of English prose paragraphs with some code
/// (~10% of paragraphs), '\n'-separated.
inline std::string english_corpus(size_t bytes, uint64_t seed) {
  using namespace detail;
  Rng rng(seed ^ 0x656E676C69736863ULL);
  return build_corpus(bytes, [&] {
    if (rng.chance(10)) return other_paragraph(rng, kCodeCat);
    return english_paragraph(rng);
  });
}

}  // namespace vlmgen::testing_text
