"""examples/bart/data/corpus.cpp's sentence splitting, written again in Python: the oracle of the tests that
check what the trainer and `bart_pretrain prepare` make of a text (check_hf.py, tests/data/check_megatron.py)."""

SPACE = b" \t\n\r\f\v"


def split_sentences(text):
    """corpus.cpp split_sentences: after '.', '!' or '?' followed by whitespace (or the end), and at blank lines;
    whitespace runs collapsed to one space; empty pieces dropped."""
    out, cur, pending = [], bytearray(), False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in SPACE:
            if c == 0x0A:  # a blank line ends a paragraph
                j = i + 1
                while j < n and text[j] in b" \t\r":
                    j += 1
                if j < n and text[j] == 0x0A:
                    if cur:
                        out.append(bytes(cur))
                    cur, pending, i = bytearray(), False, j + 1
                    continue
            pending = len(cur) > 0
            i += 1
            continue
        if pending:
            cur.append(0x20)
        pending = False
        cur.append(c)
        if c in b".!?" and (i + 1 == n or text[i + 1] in SPACE):
            out.append(bytes(cur))
            cur, pending = bytearray(), False
        i += 1
    if cur:
        out.append(bytes(cur))
    return out
