"""The byte-level BPE alphabet the Qwen tokenizers use, shared by the bench scripts."""


def byte_symbols():
    """The byte-level BPE alphabet: byte b -> one printable character (bytes that are printable
    Latin-1 map to themselves, the others to U+0100 onwards, in byte order)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return [table[b] for b in range(256)]
