"""The project's own secret patterns: only what detect-secrets 1.5.0 does not find.

Each entry says what detect-secrets misses that it covers. The secret is the named group
`secret`; everything else in a match stays. Values are checked by `not_a_secret` (the
placeholders, literals and references every detector must leave alone) before they are
redacted, as detect-secrets' own values are.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# Names that say a value is a credential. detect-secrets' keyword list has password,
# secret and *_key names but no token, credential, passphrase or auth names.
_WORDS = (
    r"passw(?:or)?d|passwd|passphrase|secret|token|api_?key|apikey|access_?key|private_?key"
    r"|account_?key|auth_?key|client_?key|credentials?|auth_?code"
)
_KEY = rf"[\w.\-]*(?:{_WORDS})[\w\-]*"
_ENV_KEY = (
    r"(?P<key>[A-Z][A-Z0-9_]*(?:PASSWORD|PASSWD|PASSPHRASE|PASS|PWD|SECRET|TOKEN|API_?KEY"
    r"|ACCESS_?KEY|PRIVATE_?KEY|ACCOUNT_?KEY|AUTH|CREDENTIALS?)[A-Z0-9_]*|PASSWORD|TOKEN|SECRET)"
)
_QUOTED = r"(?P<q>['\"`])(?P<secret>(?:(?!(?P=q))[^\n])+)(?P=q)"
_OPT_QUOTED = r"(?P<q>['\"]?)(?P<secret>[^\s'\"`$;&|<>(),\[\]{}][^\s'\"`;&|<>(),\[\]{}]*)(?P=q)"

# Names ending in `key` that hold credentials in env files and code (AZURE_STORAGE_KEY,
# SIGNING_KEY, encryption_key) but also sort keys and cache keys: their values must look
# random to count.
_ANY_KEY = r"[\w.\-]*key"
_ANY_ENV_KEY = r"(?P<key>[A-Z][A-Z0-9_]*_KEY)"
# Names whose value people choose (a password, a secret): any value counts. Other names
# (token, api_key, auth) hold generated credentials: their value must look generated, so
# a lexer's `token == "lambda"` stays.
_CHOSEN = re.compile(r"(?i)passw|passphrase|secret|credential|pwd|(?<![a-z])pass(?![a-z])")
# Names about a credential rather than holding one: `token_type`, `password_field`,
# `api_key_header`, `secret_name`, `password_hash`.
_ABOUT = re.compile(
    r"(?i)(?:type|kind|range|name|len|length|count|size|file|path|dir|field|header|prefix"
    r"|suffix|class|style|id|url|uri|endpoint|var|ttl|expiry|expires|expiration|index|idx|pos"
    r"|start|end|list|map|regex|pattern|format|fmt|hash|policy|mode|label|help|prompt|text"
    r"|message|msg|limit|min|max|required|enabled|timeout|version|store|manager|provider"
    r"|backend|cache|source|encoding|method|scheme|number|num|offset|counter)s?$"
)

# (kind, pattern, checks). Checks: "unquoted": in code, a value that reads as a name, an
# attribute, a call or a subscript is a variable (`password = new_password`), not a
# credential; "random": the value must look random (long, letters and digits).
LINE_PATTERNS: list[tuple[str, re.Pattern, str]] = [
    (k, re.compile(p), where)
    for k, p, where in [
        # URL credentials: detect-secrets' basic-auth plugin wants a user before the colon
        # and no reserved character in the password: `redis://:pw@host`, `p%21ss`, `pa!ss`.
        (
            "url_password",
            r"(?i)\b[a-z][a-z0-9+.\-]*://[^\s:/@'\"<>]*:(?P<secret>[^\s@/'\"<>]+)"
            r"@(?=[\w.\-\[])",
            "any",
        ),
        # SQL DDL: `PASSWORD 'x'`, `IDENTIFIED [WITH plugin] BY 'x'`, `SET PASSWORD ... = 'x'`
        # have no `=` or `:` between keyword and value, which detect-secrets needs.
        (
            "sql_password",
            r"(?i)\b(?:(?:ENCRYPTED\s+|UNENCRYPTED\s+)?PASSWORD(?:\s+|\s*=\s*)"
            r"|IDENTIFIED\s+(?:WITH\s+\w+\s+)?BY\s+(?:PASSWORD\s+)?|SET\s+PASSWORD\b[^;\n=]*=\s*"
            r"(?:PASSWORD\s*\(\s*)?)" + _QUOTED,
            "any",
        ),
        (
            "sql_password",
            r"(?i)\bIDENTIFIED\s+BY\s+(?!VALUES\b|PASSWORD\b)"
            r"(?P<secret>[A-Za-z][\w#$]{3,})",
            "any",
        ),
        # Command lines: `mysql -pX`, `--password X`, `sshpass -p X`, `redis-cli -a X`,
        # `docker login -p X`, `curl -u user:X`: flags, not assignments.
        (
            "cli_password",
            r"\b(?:mysql|mysqldump|mysqladmin|mariadb|mariadb-dump)\b[^\n|;]*?"
            r"\s-p(?P<q>['\"]?)(?P<secret>[^\s'\"\-][^\s'\"]*)(?P=q)",
            "any",
        ),
        ("cli_password", r"(?<![\w\-])--(?:[\w\-]*-)?pass(?:word)?(?:=|\s+)" + _OPT_QUOTED, "any"),
        (
            "cli_password",
            r"\b(?:sshpass[\s'\",]+-p|redis-cli\b[^\n|;]*?[\s'\",]-a|docker\s+login"
            r"\b[^\n|;]*?\s(?:-p|--password))[\s'\",]+(?P<q>['\"]?)(?P<secret>[^\s'\"$][^\s'\",]*)"
            r"(?P=q)",
            "any",
        ),
        (
            "cli_password",
            r"(?<![\w\-])(?:-u|--user)[\s=]+['\"]?[^\s:'\"$]+:(?P<secret>[^\s'\"@]+)",
            "any",
        ),
        # `NAME=value` in env files, shells and `docker -e`: detect-secrets' keyword regexes
        # either want quotes or flag every variable in code; upper-case names are settings.
        ("env_secret", rf"(?<![\w.])(?:{_ENV_KEY})=" + _OPT_QUOTED, "any"),
        ("env_secret", rf"(?<![\w.])(?:{_ANY_ENV_KEY})=" + _OPT_QUOTED, "random"),
        # Names detect-secrets lacks (token, credential...), and type annotations
        # (`client_secret: str = "x"`), which its regexes do not read.
        (
            "assigned_secret",
            rf"(?i)(?<![\w.\-])(?P<key>{_KEY})['\"\]]{{0,2}}\s*"
            r"(?::\s*[\w\[\]., |]+?\s*)?(?::=|=>|==?|:)\s*b?" + _QUOTED,
            "any",
        ),
        (
            "assigned_secret",
            rf"(?i)(?<![\w.\-])(?P<key>{_ANY_KEY})['\"\]]{{0,2}}\s*"
            r"(?::\s*[\w\[\]., |]+?\s*)?(?::=|=>|==?|:)\s*b?" + _QUOTED,
            "random",
        ),
        # Unquoted values of a keyword argument or setting (`token=abc` in a log line, a
        # libpq `password=x` inside a string).
        ("assigned_secret", rf"(?i)(?<![\w.\-])(?P<key>{_KEY})=" + _OPT_QUOTED, "unquoted"),
        # Whole setting lines (YAML, INI, properties): `password: hunter2`.
        (
            "config_secret",
            rf"(?im)^[ \t]*(?:-[ \t]+)?(?P<key>{_KEY})[ \t]*[:=][ \t]*"
            r"(?P<q>['\"]?)(?P<secret>[^\s'\"#][^\s'\"]*?)(?P=q)[,;]?[ \t]*(?:[ \t]#.*)?$",
            "unquoted",
        ),
        # Query strings: `?api_key=..`, `&access_token=..`, Azure SAS `&sig=..`.
        (
            "query_secret",
            rf"(?i)[?&;](?P<key>{_KEY}|pwd|pass|key|sig|signature)="
            r"(?P<secret>[^&#\s'\"<>]{4,})",
            "any",
        ),
        # Authorization headers with opaque credentials (detect-secrets reads JWT-shaped
        # bearer tokens only), and the API-key headers services document.
        (
            "auth_header",
            r"(?i)\b(?:bearer|basic|token|digest|apikey)\s+"
            r"(?P<secret>[A-Za-z0-9\-._~+/]{16,}=*)",
            "any",
        ),
        (
            "auth_header",
            r"(?i)\b(?:private-token|x-api-key|api-key|x-auth-token)['\"]?\s*[:=]"
            r"\s*['\"]?(?P<secret>[A-Za-z0-9\-._~+/]{12,}=*)",
            "any",
        ),
        # Positional passwords: `auth=("u", "pw")`, `HTTPBasicAuth("u", "pw")`, `.login(u, "pw")`.
        (
            "auth_pair",
            r"(?:\bauth\s*=\s*[(\[]|\b\w*(?:Basic|Digest|Proxy)Auth\s*\(|\.login\s*\()"
            r"\s*(?:b?['\"][^'\"\n]*['\"]|[\w.]+)\s*,\s*b?['\"](?P<secret>[^'\"\n]+)['\"]",
            "any",
        ),
        # Formats with no detect-secrets plugin (or one matching an old, shorter form):
        # Google API keys, Hugging Face, E2B, Anthropic, OpenAI project keys without the
        # marker it looks for, GitHub fine-grained tokens, npm tokens outside .npmrc,
        # Databricks, DigitalOcean, Shopify, Square access tokens, Azure shared access keys.
        (
            "api_token",
            r"\b(?:AIza[0-9A-Za-z_\-]{35}|hf_[A-Za-z0-9]{30,}|e2b_[0-9a-f]{30,}"
            r"|sk-ant-(?:api|admin)\d\d-[A-Za-z0-9_\-]{80,}|sk-(?:proj|svcacct|admin)-"
            r"[A-Za-z0-9_\-]{40,}|github_pat_[A-Za-z0-9_]{60,}|npm_[A-Za-z0-9]{36}"
            r"|dapi[0-9a-f]{32}|do[por]_v1_[0-9a-f]{64}|shp(?:at|ca|pa|ss)_[0-9a-fA-F]{32}"
            r"|EAAA[A-Za-z0-9_\-]{60}|sq0atp-[0-9A-Za-z_\-]{22})(?![\w\-])",
            "any",
        ),
        (
            "azure_key",
            r"(?i)\b(?:AccountKey|SharedAccessKey|SharedAccessSignature)\s*=\s*"
            r"(?P<secret>[A-Za-z0-9+/%&:=._\-]{16,}?)(?=;|['\"\s]|$)",
            "any",
        ),
    ]
]

# Spans over several lines: a PEM private key (detect-secrets reports its BEGIN line
# only; the key is the body), also with `\n` escapes as JSON holds it.
PEM_BLOCK = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----.*?"
    r"(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|\Z)",
    re.S,
)
# SQL DML: the column that names the secret and its value are far apart.
_INSERT = re.compile(
    r"(?is)\binsert\s+into\s+[\w.\"`\[\]]+\s*\((?P<cols>[^)]*)\)\s*values\s*(?P<rows>(?:\([^;]*?\)"
    r"\s*,?\s*)+)"
)
_SECRET_COLUMN = re.compile(r"(?i)pass|secret|token|api_?key|credential|private_?key")
# DuckDB secrets: `CREATE SECRET (TYPE s3, KEY_ID 'x', SECRET 'y')`: key-space-value pairs.
_DUCKDB = re.compile(
    r"(?is)\bcreate\s+(?:or\s+replace\s+)?(?:persistent\s+|temporary\s+)?secret\b[^(;]*"
    r"\((?P<body>[^)]*)\)"
)
_DUCKDB_VALUE = re.compile(
    r"(?i)\b(?:secret|session_token|token|password|client_secret|account_key|"
    r"connection_string|bearer_token)\s+'(?P<secret>[^']+)'"
)
_SQL_LITERAL = re.compile(r"'(?:[^']|'')*'|[^,()']+")


def _sql_values(row: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of each comma-separated value of one VALUES tuple."""
    return [
        (m.start(), m.end(), m.group()) for m in _SQL_LITERAL.finditer(row) if m.group().strip()
    ]


def block_spans(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, kind) of secrets that span lines or need a statement's structure."""
    for m in PEM_BLOCK.finditer(text):
        yield m.start(), m.end(), "private_key"
    for m in _INSERT.finditer(text):
        cols = [c.strip(" \"`'[]\n") for c in m.group("cols").split(",")]
        for row in re.finditer(r"\(([^()]*)\)", m.group("rows")):
            values = _sql_values(row.group(1))
            if len(values) != len(cols):
                continue
            base = m.start("rows") + row.start(1)
            for col, (start, _, value) in zip(cols, values, strict=True):
                if _SECRET_COLUMN.search(col) and value.strip().startswith("'"):
                    inner = value.strip()[1:-1]
                    if not not_a_secret(inner, col):
                        offset = base + start + value.index("'") + 1
                        yield offset, offset + len(inner), "sql_secret_value"
    for m in _DUCKDB.finditer(text):
        for v in _DUCKDB_VALUE.finditer(m.group("body")):
            if not not_a_secret(v.group("secret")):
                start = m.start("body") + v.start("secret")
                yield start, start + len(v.group("secret")), "sql_secret_value"


# Values that never are the secret itself.
_LITERALS = {
    "pass",
    "true",
    "false",
    "none",
    "null",
    "nil",
    "undefined",
    "yes",
    "no",
    "on",
    "off",
    "required",
    "optional",
    "empty",
    "hidden",
    "redacted",
    "masked",
    "secret",
    "password",
    "token",
}
_TYPE = re.compile(
    r"(?:str|string|bytes|int|float|bool|number|any|object|dict|list|Optional\[\w+\]"
    r"|Secret\w*|SecretStr|[A-Z][a-z]+(?:[A-Z][a-z]+)+|\w+\[[\w\[\], .|]*\])"
)
_PLACEHOLDER = re.compile(
    r"(?i)^(?:your[\w\-. ]*|(?:my|enter|insert|replace)[_\-. ][\w\-. ]*)$|^<[^<>]*>$"
    r"|^\[[\w\- ]+\]$|\.\.\.|…|^x{4,}$|^\*{3,}$|^#{3,}$|^-+$|^%[sd]$|^\{\w*\}$|^\?$|^:\w+$"
    # Words, not letters inside a random key (a base64 key may well hold `FAkE`).
    r"|(?<![a-z])(?:redacted|masked|example|placeholder|dummy|fake|changeme|change_me"
    r"|replace_me|not[\-_ ]a[\-_ ]real|x{4,}|deadbeef|cafebabe)(?![a-z])"
    # AWS's documentation keys: AKIAIOSFODNN7EXAMPLE, wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY.
    r"|(?-i:EXAMPLE)"
)
_REFERENCE = re.compile(
    r"^(?:\$|%\(|os\.environ|process\.env|env\(|getenv|ENV\[|secrets\.|vault:|arn:aws)"
    r"|\$\{|\{\{"  # a template anywhere: `Basic ${btoa(user)}`, `{{ api_key }}`
    r"|^(?:~|\.{1,2})?(?:/[\w.\-]{1,16})+/?$|^[\w.\-]+\.(?:txt|json|ya?ml|pem|key|env|cfg|ini|conf|crt)$"
)
_NAME = r"[A-Za-z_]\w*"
_SCHEME = re.compile(r"(?i)^(?:bearer|basic|token|digest)\s+")
_CODE_VALUE = re.compile(rf"{_NAME}(?:\.{_NAME})*(?:[(\[].*)?")
# In any text: a call, a subscript or an attribute (`getpass.getpass()`, `cfg.password`),
# as traceback frames and printed settings show code.
_EXPRESSION = re.compile(rf"{_NAME}(?:(?:\.{_NAME})+(?:[(\[].*)?|[(\[].*)")


def not_a_secret(value: str, key: str | None = None) -> bool:
    """A placeholder, literal, type, number, reference or file name: never redacted."""
    v = _SCHEME.sub("", value.strip().strip("'\"`"))  # `Bearer xxxx`: the credential is xxxx
    if len(v) < 4 or v.lower() in _LITERALS or v.isdigit() or _TYPE.fullmatch(v):
        return True
    if _PLACEHOLDER.search(v) or _REFERENCE.search(v):
        return True
    if key is not None and _names_itself(v, key):
        return True  # `password: password`, `token=TOKEN`, `password="some_password"`
    if key is not None and re.match(r"(?i)https?://", v):
        return True  # a URL under a name; credentials inside it are the URL patterns' job
    return len(set(v)) <= 2  # `aaaaaaaa`, `12121212`


def _names_itself(value: str, key: str) -> bool:
    """The value is the key's name, or letters around the credential word of the key:
    what docs write where a value goes (`some_password`, `myregistrytoken`)."""
    v, k = value.lower().replace("-", "_"), key.lower().replace("-", "_")
    if v in k:
        return True
    word = _CREDENTIAL_WORD.search(k)
    return bool(word) and word.group() in v and re.fullmatch(r"[a-z_]+", v) is not None


_CREDENTIAL_WORD = re.compile(r"passw(?:or)?d|passphrase|secret|token|key|credential|auth")


def key_rule(key: str | None) -> str:
    """What a value under this name must be to be redacted: "any" (a chosen secret),
    "random" (a generated credential), or "none" (the name is about a credential)."""
    if key is None:
        return "any"
    last = re.split(r"[_\-.]", key.strip("'\"[]"))[-1]
    if _ABOUT.fullmatch(last) and not _CHOSEN.fullmatch(last):
        return "none"
    return "any" if _CHOSEN.search(key) else "random"


def looks_random(value: str) -> bool:
    """Long, with letters and digits: how generated keys look (field names do not)."""
    return (
        len(value) >= 16
        and any(c.isdigit() for c in value)
        and any(c.isalpha() for c in value)
        and not value.isidentifier()
    ) or len(value) >= 32


def _random_part(value: str) -> bool:
    """A part (between dots, dashes, underscores) of 8+ chars with upper and lower case
    letters and digits: generated, not a name a programmer wrote."""
    return any(
        len(p) >= 8 and re.search(r"\d", p) and re.search(r"[a-z]", p) and re.search(r"[A-Z]", p)
        for p in re.split(r"[._\-]", value)
    )


def code_value(value: str, in_code: bool) -> bool:
    """A name, attribute, call or subscript (in code), or an attribute, call or subscript
    (in any text): what an assignment in code assigns, not a credential. A dotted chain
    with a generated-looking part (`x8tpz53vZ.oXEeJVgm19`) is a token, not an attribute."""
    if in_code and re.search(r"[()\[\]{}+*]", value):
        return True  # an expression: `(self.tokens.peek()`, `taken+len(tokens)`
    if (_CODE_VALUE if in_code else _EXPRESSION).fullmatch(value) is None:
        return False
    return "(" in value or "[" in value or "." not in value or not _random_part(value)
