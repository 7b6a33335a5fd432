"""Where a credential stands in one line, read from its context.

Two readings of every line that holds a cue (name_cues.py):
- key first: a credential name, then an assignment (`=`, `:`, `:=`, `=>`, `<-`, a flag's
  space), then its value, in the syntax of any language E2B runs, of settings files and
  of HTTP headers; under a chosen-secret name any value counts, under a token name the
  value must look generated (shape.py);
- value first: every generated-looking token, judged by what stands to its left: the
  nearest name (`"apiKey": "..."`, `--token ...`, `login ...`, `add-authtoken ...`, a
  name/value row `api_key | ...`), the callee of a call it is an argument of
  (`Client('...')`, `Fernet(b'...')`), a few prose words (`token in use: ...`), or a line
  about failed authentication (`401 Unauthorized`), where an id keeps its own name.
A value that keep.py calls a placeholder, reference or public key is never returned.
"""

from __future__ import annotations

import re

from capibara_exp.data.e2b.scrub import formats, keep, name_cues, shape

REDACTED = "<REDACTED:"
# Stems a credential name holds (names.rule decides; this only finds candidates fast).
STEMS = (
    r"pass|pwd|secret|token|key|auth|cred|bearer|sig|sas|pat|dsn|webhook|cookie|session"
    r"|login|signin|otp|hmac|licen|jeton|chave|cl[ée]|chiave|llave|schl[üu]|sleutel|klucz|nyckel|avain|kennwort|passwort|contrase"
    r"|senha|mdp|parola|wachtwoord|has[lł]o|losenord|salasana|jelsz|[sş]ifre|heslo|geslo"
    r"|lozinka|parol|пароль|ключ|токен|密码|密碼|口令|パスワード|비밀번호|암호|令牌|密钥|キー"
    r"|トークン|토큰|geheim|segreto|secreto|clave"
)
_NAME = rf"[\w.\-]*(?:{STEMS})[\w.\-]*"
_QUOTED = r"(?P<q>'''|\"\"\"|['\"`])(?P<qv>(?:(?!(?P=q))[^\n\\]|\\.)*)(?P=q)"
_BARE = r"(?P<uv>[^\s'\"`,;)}\]<>&|]+)"
# name [quote] [: type] separator [string prefix] value
ASSIGN = re.compile(
    rf"(?i)(?<![\w.\-])-{{0,2}}(?P<key>{_NAME})['\"\]`]{{0,2}}\s*"
    r"(?::\s*[\w\[\]., |<>?]+?\s*=(?!=)|:=|=>|<-|==|=|:)\s*(?:[bruf]{1,2}|@|L)?"
    rf"(?:{_QUOTED}|{_BARE})"
)
# a flag and its value after a space: `--password hunter2`, `--api-key "..."`
FLAG = re.compile(rf"(?i)(?<![\w\-])--?(?P<key>{_NAME})[ \t]+(?!-)(?:{_QUOTED}|{_BARE})")
# an XML element: `<password>...</password>`
XML = re.compile(rf"(?i)<(?P<key>{_NAME})>(?P<qv>[^<\n]{{4,200}})</(?P=key)>")
# Candidates for the value-first reading: runs that may be generated.
CANDIDATE = re.compile(
    r"(?<![\w+/=.~%\-])(?:\d{5,12}:)?[\w+/%\-][\w\-+/.~%]{12,}[A-Za-z0-9]={0,2}"
    r"(?::[\w\-+/.~%]{8,}={0,2})*"
)
_URL_START = re.compile(r"[a-z][a-z0-9+.\-]*://", re.I)
# A line about failed authentication: every generated value on it is suspect.
AUTH_ERROR = re.compile(
    r"(?i)\b(?:401|403)\b|unauthori[sz]ed|unauthenticated|forbidden|not authenticated"
    r"|authentication (?:failed|failure|error|required)|auth(?:orization)? (?:failed|error)"
    r"|(?:invalid|incorrect|expired|revoked|bad|unknown|malformed) (?:api[ _-]?)?"
    r"(?:key|token|credential|secret|signature|password)|access denied|permission denied"
    r"|login failed|invalid_(?:token|grant|client)"
)
# Words that may stand between a cue and its value in prose: `token in use: ...`.
_PROSE = frozenset(
    "in use used is was for of the a an as with using provided given supplied value set "
    "new current old your my this that has been valid not found".split()
)
# Words of prose that are cues on their own: `authenticated as ci-bot (...)`.
_PROSE_CUES = frozenset(
    "authenticated authenticate authenticating authorized authorize unauthorized "
    "unauthorised unauthenticated forbidden logged revoked".split()
)
# Callees whose positional string arguments are credentials: `ApiClient("...")`,
# `Fernet(b"...")`, `hmac.new(b"...", msg)`, `set_api_key("...")`.
_CALLEE_LAST = frozenset(
    "client auth authenticate authenticator login signin key token tokens secret password "
    "credential credentials fernet bot hmac jwt cipher signer bearer oauth oauth2 sdk".split()
)
_CALLEE_FIRST = frozenset("hmac jwt fernet cipher aes".split())
# A key that says the value is not a credential: ids, digests, versions, images.
_NOT_CUES = frozenset(
    "id ids uuid guid request trace span correlation commit etag sha sha1 sha256 sha512 md5 "
    "hash digest checksum crc build version revision rev image blob object tree run job "
    "task event message order user account file path url".split()
)
_SEPARATORS = frozenset(" \t'\"`:=,([]{<>@|│*+!")
# Type annotations between a name and its value: `apiKey: string = "..."`.
_TYPES = frozenset(
    "string str String bytes any object Final Optional char var let const val".split()
)
_STRING_PREFIXES = frozenset({"b", "r", "u", "f", "rb", "br", "B", "R", "U", "F", "L"})
_SCHEME = re.compile(r"(?i)^(?:bearer|basic|token|digest|apikey|key)\s+")
_URL = re.compile(r"(?i)^[a-z][a-z0-9+.\-]*://")


def callee_cue(name: str) -> bool:
    ws = name_cues.words(name)
    return bool(ws) and (
        ws[-1] in _CALLEE_LAST
        or ws[0] in _CALLEE_FIRST
        or name_cues.rule(name.rsplit(".", 1)[-1]) in ("chosen", "generated")
    )


def value_is_secret(value: str, key: str, rule: str | None, in_code: bool | None) -> bool:
    """Whether `value`, standing under the name `key` with its rule, is a credential.
    `in_code`: None for a quoted value; else whether the unquoted value stands in code."""
    if rule not in ("chosen", "generated"):
        return False
    bare = _SCHEME.sub("", value.strip())
    if keep.not_a_secret(value, key) or keep.not_a_secret(bare, key):
        return False
    if in_code is not None and keep.code_value(value, in_code):
        return False  # `password = new_password`: a variable
    if _URL.match(bare):
        return False  # a URL under a name: its credentials are read by urls()
    return rule == "chosen" or shape.generated(bare)


def _value_span(m: re.Match) -> tuple[int, int, str]:
    group = "qv" if m.group("qv") is not None else "uv"
    return m.start(group), m.end(group), m.group(group)


def key_first(line: str, in_code) -> list[tuple[int, int, str]]:
    """Values under credential names: assignments, settings, flags, XML elements."""
    out = []
    for regex, kind in ((ASSIGN, "assigned_secret"), (FLAG, "cli_secret"), (XML, "xml_secret")):
        for m in regex.finditer(line):
            if regex is XML:
                lo, hi, value, code = m.start("qv"), m.end("qv"), m.group("qv"), None
            else:
                lo, hi, value = _value_span(m)
                code = None if m.group("qv") is not None else in_code(lo)
            key = m.group("key").lstrip("-")
            if value_is_secret(value, key, name_cues.rule(key), code):
                out.append((lo + len(value) - len(_SCHEME.sub("", value)), hi, kind))
    return out


def _name_before(line: str, end: int) -> int:
    """Start of the name that ends at `end` (word characters, dots, dashes, `$`)."""
    start = end
    while start > 0 and (line[start - 1].isalnum() or line[start - 1] in "_.-$"):
        start -= 1
    return start


def left_cue(line: str, start: int) -> str | None:
    """The rule of the cue left of position `start`, or None: the nearest name, a callee,
    or up to three words of prose. A comma right of the value makes a name/value pair
    (`'api_key', '<value>'`); a comma further left only lets a callee count, so in
    `{"api_key": "x", "other": "<value>"}` the value stays `other`'s."""
    i, hops, callee_only = start, 0, False
    while hops <= 3:
        j = i
        while j > 0 and (line[j - 1] in _SEPARATORS or line[j - 2 : j] == "<-"):
            j -= 1
        seps = line[j:i]
        k = _name_before(line, j)
        name = line[k:j].strip(".-")
        if not name or line.endswith(REDACTED, 0, k):
            return None  # nothing, or a redaction (its kind is no key)
        if name in _STRING_PREFIXES or (name in _TYPES and ":" in line[max(0, k - 3) : k]):
            i = k
            continue
        if "(" in seps and callee_cue(name):
            return "generated"
        pair = "," in seps and i == start
        callee_only = callee_only or ("," in seps and not pair)
        rule = name_cues.rule(name)
        ws = name_cues.words(name)
        if not callee_only:
            if rule == "none" or (ws and ws[-1] in _NOT_CUES):
                return None
            if rule is not None:
                return rule
            if name.lower() in _PROSE_CUES:
                return "generated"
            if not pair and ("=" in seps or not _prose_word(name)):
                return None
        callee_only = callee_only or pair
        hops, i = hops + 1, k
    return None


def _prose_word(name: str) -> bool:
    return name.lower() in _PROSE or (name.isalpha() and len(name) <= 24 and not name.isupper())


def value_first(line: str, in_code, exclude) -> list[tuple[int, int, str]]:
    """Generated-looking tokens with a cue to their left, or on a line about failed auth."""
    out = []
    auth_error = AUTH_ERROR.search(line) is not None
    for m in CANDIDATE.finditer(line):
        value = m.group().rstrip(".")
        lo, hi = m.start(), m.start() + len(value)
        url = _URL_START.search(line, max(0, lo - 24), lo + 2)
        url = url if url is not None and lo <= url.end() <= lo + 2 else None
        if url is not None:  # a URL's path: judged from where the URL starts
            path = value.find("/", 2 if value.startswith("//") else 0)
            if path == -1:
                continue
            lo, value = lo + path, value[path:]
        if in_code(lo) and re.fullmatch(r"[A-Za-z_][\w.]*", value):
            continue  # a name in code, not a literal
        kind = shape.kind(value)
        if kind == "text" or keep.not_a_secret(value) or formats.public(value, exclude):
            continue
        at = url.start() if url is not None else lo
        rule = left_cue(line, at)
        if rule is None and auth_error and not _named_otherwise(line, lo):
            rule = "generated"
        if rule is None and kind != "payload" and _constructor_argument(line, at, kind, value):
            rule = "generated"
        if rule is not None:
            out.append((lo, hi, "cued_token"))
    return out


def _named_otherwise(line: str, start: int) -> bool:
    """The value has a name of its own that is no credential (`request_id: ...`)."""
    j = start
    while j > 0 and line[j - 1] in _SEPARATORS:
        j -= 1
    name = line[_name_before(line, j) : j]
    ws = name_cues.words(name)
    return bool(ws) and (ws[-1] in _NOT_CUES or name_cues.rule(name) == "none")


# Constructors that take a generated value that is no credential.
_NOT_CONSTRUCTORS = frozenset(
    "hex bytes bytearray int str float decimal date datetime time color colour uuid guid "
    "ulid oid objectid snowflake key path purepath url uri node record row entity model".split()
)
_CLIENT_VARS = _CALLEE_LAST | {"api", "sdk", "service", "conn", "connection", "bot"}
_ASSIGNED = re.compile(r"(\w+)\s*(?::\s*\w+\s*)?=\s*$")
_CONSTRUCTOR = re.compile(
    r"\b(?:new\s+)?(?:[\w.]*\.)?([A-Z][a-z]\w*)\(\s*(?:[bruf]{1,2}|@)?['\"`]$"
)


def _constructor_argument(line: str, start: int, kind: str, value: str) -> bool:
    """The first argument of a constructor named by no id or digest word: an SDK's client
    (`Zorblax("<token>")`). A bare UUID stays: models take ids (`Customer("<uuid>")`)."""
    m = _CONSTRUCTOR.search(line, max(0, start - 80), start)
    if m is None or (kind == "uuid" and shape.UUID.fullmatch(value)):
        return False
    if set(name_cues.words(m.group(1))) & (_NOT_CUES | _NOT_CONSTRUCTORS):
        return False
    if kind == "token":
        return True
    # a digest-shaped argument counts only when what it makes is named as a client
    var = _ASSIGNED.search(line, max(0, m.start() - 40), m.start())
    return var is not None and bool(set(name_cues.words(var.group(1))) & _CLIENT_VARS)
