"""Deterministic corpus for the tokenizer and chat-template golden tests.

`strings()` returns a few thousand str values covering English, code, CJK, emoji, whitespace runs, digits,
accents and other scripts, and look-alikes of special tokens; `invalid_utf8()` returns byte strings that are not
valid UTF-8. The same seed always gives the same corpus.
"""

import random

SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
            "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[PAD]"]

WORDS = ("the of and to in is that it was for on are as with his they at be this from have or by one had not but "
         "what all were when we there can an your which their said if do will each about how up out them then she "
         "many some so these would other into has more her two like him see time could no make than first been its "
         "who now people my made over did down only way find use may water long little very after words called just "
         "where most know get through back much before go good new write our used me man too any day same right "
         "look think also around another came come work three word must because does part even place well such "
         "tokenizer kestrel inference attention sparse hybrid streaming detokenisation Byte-Pair encoding "
         "don't can't won't it's I'm you're we've they'll she'd HE'S DON'T I'LL Ain't o'clock").split()

CODE = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; return v.size(); }\n",
    '{"role": "user", "content": "hi", "n": 42, "ok": true, "x": null}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "    if (a && b || !c) { x <<= 2; y >>= 3; z ^= ~w; }",
    "const re = /^[a-z_][a-z0-9_]*$/i; // identifier",
    "fn main() -> Result<(), Box<dyn Error>> {\n    println!(\"{:?}\", vec![1u8; 4]);\n    Ok(())\n}",
    "x = [i**2 for i in range(10) if i % 3 == 0]  # squares",
    "<html><body><p class=\"a\">Hello &amp; bye</p></body></html>",
    "$ ls -la /usr/lib | grep -E '^d' > out.txt 2>&1",
    "\t\tindented_with_tabs = True\r\n\t\treturn None\r\n",
]

CJK = "的一是不了人我在有他这中大来上个国到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坏兴切批"
KANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワヲンー"
HANGUL = "가나다라마바사아자차카타파하한국어입니다감사합니다안녕하세요"
OTHER_SCRIPTS = ["Привет, мир! Как дела?", "Γειά σου Κόσμε", "مرحبا بالعالم ١٢٣", "שלום עולם", "नमस्ते दुनिया ४५६",
                 "สวัสดีชาวโลก", "Ünïcödé ñ café naïve résumé", "e\u0301 a\u0308 o\u0302 combining", "ǅemal ǈ ǋ titlecase",
                 "ﬁ ﬂ ligatures", "Ｆｕｌｌｗｉｄｔｈ １２３ ＡＢＣ", "ℕ ℤ ℚ ℝ ∑ ∫ √ ∞ ≠ ≤ ≥", "½ ¾ ² ³ Ⅻ ⅷ ①②③"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "🏳️‍🌈", "❤️", "🤖", "🔥🔥🔥", "✅", "🧑🏻‍💻", "🐍", "☕", "🎉"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2003", "\u200b", "   \n", " \t ", "\x0b", "\x0c",
          "\u2028", "\u0085"]


def _word(r):
    w = r.choice(WORDS)
    k = r.random()
    if k < 0.1:
        return w.upper()
    if k < 0.25:
        return w.capitalize()
    return w


def _english(r):
    n = r.randint(1, 25)
    parts = []
    for i in range(n):
        parts.append(_word(r))
        if r.random() < 0.1:
            parts[-1] += r.choice([",", ";", ":", "!", "?", ".", "...", "'s", "'S", "'ll", "—", "\""])
    s = " ".join(parts)
    if r.random() < 0.5:
        s = s[0].upper() + s[1:] + r.choice([".", "!", "?", "", "\n"])
    return s


def _digits(r):
    k = r.randint(0, 6)
    if k == 0:
        return str(r.randint(0, 10 ** r.randint(1, 20)))
    if k == 1:
        return f"{r.uniform(-1e6, 1e6):.{r.randint(0, 8)}f}"
    if k == 2:
        return f"v{r.randint(0, 99)}.{r.randint(0, 99)}.{r.randint(0, 999)}-rc{r.randint(1, 9)}"
    if k == 3:
        return "".join(r.choice("0123456789abcXYZ_-") for _ in range(r.randint(3, 30)))
    if k == 4:
        return f"{r.randint(1, 31):02d}/{r.randint(1, 12):02d}/{r.randint(1900, 2100)} {r.randint(0, 23)}:{r.randint(0, 59):02d}"
    if k == 5:
        return " ".join(str(r.randint(0, 10 ** 6)) for _ in range(r.randint(2, 8)))
    return "".join(r.choice("٠١٢٣٤٥٦٧٨٩०१२३४५６７８９") for _ in range(r.randint(1, 12)))


def _cjk(r):
    pool = r.choice([CJK, KANA, HANGUL, CJK + KANA])
    s = "".join(r.choice(pool) for _ in range(r.randint(1, 30)))
    if r.random() < 0.4:
        s += r.choice(["，", "。", "！", "？", "、", "「", "」", " ", "abc", "123", "\n"]) + "".join(
            r.choice(pool) for _ in range(r.randint(0, 10)))
    if r.random() < 0.3:
        s = _word(r) + s
    return s


def _whitespace(r):
    s = ""
    for _ in range(r.randint(1, 8)):
        s += r.choice(SPACES) * r.randint(1, 5)
        if r.random() < 0.5:
            s += _word(r)
    return s


def _lookalike(r):
    sp = r.choice(SPECIALS)
    k = r.randint(0, 7)
    if k == 0:
        return sp
    if k == 1:
        return _word(r) + sp + _word(r)
    if k == 2:
        return sp[:-1]
    if k == 3:
        return sp + sp + " " + r.choice(SPECIALS)
    if k == 4:
        return sp.replace("|", "｜")
    if k == 5:
        return sp.upper() + " " + sp[1:]
    if k == 6:
        return "<" + sp + ">"
    return " " + sp + "\n" + _english(r)


def _mixed(r):
    gens = [_english, _digits, _cjk, _whitespace, _lookalike]
    s = ""
    for _ in range(r.randint(2, 5)):
        s += r.choice(gens)(r)
        if r.random() < 0.3:
            s += r.choice(EMOJI)
        if r.random() < 0.2:
            s += r.choice(OTHER_SCRIPTS)
    return s


def _random_unicode(r):
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0x2000, 0x206F), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F64F),
              (0xFF00, 0xFFEF), (0x10000, 0x1007F)]
    out = []
    for _ in range(r.randint(1, 20)):
        lo, hi = r.choice(ranges)
        out.append(chr(r.randint(lo, hi)))
    return "".join(out)


def strings(n=3000, seed=1234):
    r = random.Random(seed)
    out = [""] + list(CODE) + list(OTHER_SCRIPTS) + list(EMOJI) + list(SPECIALS) + list(SPACES)
    out += [" " * k for k in (1, 2, 3, 7, 16, 65, 200)] + ["\n" * 70, "a" * 300, "中" * 150, "1" * 100, "😀" * 40]
    out += [s.upper() for s in ["it's", "we'll", "they've", "i'd", "you're"]]
    gens = [_english] * 5 + [_digits] * 2 + [_cjk] * 2 + [_whitespace] * 2 + [_lookalike] * 2 + [_mixed] * 4 + [
        _random_unicode] * 2 + [lambda r: r.choice(CODE) * r.randint(1, 3)]
    while len(out) < n - 20:
        out.append(r.choice(gens)(r))
    # Long texts (past the 4 KiB where Kestrel's encoder starts caching repeated pieces).
    while len(out) < n:
        out.append("".join(r.choice(out[:n - 20]) + r.choice(["", " ", "\n"]) for _ in range(r.randint(150, 400))))
    return out


def invalid_utf8(n=200, seed=99):
    r = random.Random(seed)
    base = [b"\xff", b"\xc0\xaf", b"\xe4\xb8", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80\x80", b"abc\xfe",
            b"\xf0\x9f\x98", "中".encode()[:2] + b"x"]
    out = list(base)
    while len(out) < n:
        s = r.choice(strings(200, seed=7)).encode()
        b = bytearray(s)
        for _ in range(r.randint(1, 3)):
            pos = r.randint(0, len(b))
            b[pos:pos] = bytes([r.choice([0x80, 0xbf, 0xc0, 0xc1, 0xc3, 0xe2, 0xed, 0xf0, 0xf5, 0xff])])
        try:
            bytes(b).decode("utf-8")
        except UnicodeDecodeError:
            out.append(bytes(b))
    return out


def training_text(seed=5, n=4000):
    """Text for training small BPE vocabularies in the tests."""
    r = random.Random(seed)
    return [_mixed(r) if i % 3 else _english(r) for i in range(n)]
