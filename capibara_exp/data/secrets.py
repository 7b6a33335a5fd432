"""Secret scrubbing: API keys, tokens, passwords and private keys become `<REDACTED:kind>`.

Everything that becomes training data passes through `scrub`. `seeded_secrets` makes a
seeded set of texts with planted secrets in code, config and log contexts, so recall is
measured (tests and every build's manifest), not assumed.
"""

from __future__ import annotations

import random
import re
import string

# (kind, pattern): the whole match is the secret unless the pattern has a group named 'secret'.
_PATTERNS: list[tuple[str, re.Pattern]] = [
    (k, re.compile(p, f))
    for k, p, f in [
        (
            "private_key",
            r"-----BEGIN (?:[A-Z]+ )*PRIVATE KEY-----.*?"
            r"(?:-----END (?:[A-Z]+ )*PRIVATE KEY-----|\Z)",
            re.S,
        ),
        ("aws_access_key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b", 0),
        ("github_token", r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})\b", 0),
        ("openai_key", r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}\b", 0),
        ("stripe_key", r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}\b", 0),
        ("slack_token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b", 0),
        ("google_api_key", r"\bAIza[0-9A-Za-z_\-]{35}\b", 0),
        ("e2b_key", r"\be2b_[0-9a-f]{30,}\b", 0),
        ("huggingface_token", r"\bhf_[A-Za-z0-9]{30,}\b", 0),
        ("jwt", r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\b", 0),
        ("url_credentials", r"(?<=://)(?P<secret>[^\s:/@'\"]+:[^\s@/'\"]+)(?=@)", 0),
        ("bearer_token", r"(?i)\b(?:bearer|token)\s+(?P<secret>[A-Za-z0-9_\-.=+/]{16,})", 0),
        (
            "assigned_secret",
            r"(?i)(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|auth|credentials?|private[_-]?key)"
            r"[\w\-]*['\"]?\s*(?:[:=]|=>)\s*(?:b?['\"](?P<secret>[^'\"\s]{4,})['\"]|(?P<bare>[^\s'\",;()\[\]{}]{8,}))",
            0,
        ),
    ]
]


_SQL_INSERT = re.compile(
    r"(?is)\binsert\s+into\s+[\w.\"`]+\s*\((?P<cols>[^)]*)\)\s*values\s*\((?P<vals>[^)]*)\)"
)
_SECRET_COLUMN = re.compile(r"(?i)pass|secret|token|api_?key|credential")


def _scrub_sql_insert(match: re.Match, counts: dict[str, int]) -> str:
    """INSERT INTO t(name, password) VALUES ('bob', 'x'): redact values of secret columns."""
    cols = [c.strip(" \"`'") for c in match.group("cols").split(",")]
    vals = match.group("vals").split(",")
    if len(cols) != len(vals):
        return match.group(0)
    for i, col in enumerate(cols):
        if _SECRET_COLUMN.search(col) and vals[i].strip().startswith("'"):
            vals[i] = " '<REDACTED:sql_secret_value>'" if i else "'<REDACTED:sql_secret_value>'"
            counts["sql_secret_value"] = counts.get("sql_secret_value", 0) + 1
    whole, base = match.group(0), match.start(0)
    start, end = match.span("vals")
    return whole[: start - base] + ",".join(vals) + whole[end - base :]


def _is_code_reference(value: str) -> bool:
    """`token = self.token` or `key = get_key`: a name in code, not a secret value."""
    return re.fullmatch(r"[A-Za-z_][A-Za-z_.]*", value) is not None


def _replace(kind: str, match: re.Match) -> str:
    for group in ("secret", "bare"):
        if group in match.re.groupindex and match.group(group) is not None:
            start, end = match.span(group)
            whole = match.group(0)
            base = match.start(0)
            return whole[: start - base] + f"<REDACTED:{kind}>" + whole[end - base :]
    return f"<REDACTED:{kind}>"


def scrub(text: str) -> tuple[str, dict[str, int]]:
    """The text with every secret found replaced, and the count per kind."""
    counts: dict[str, int] = {}
    text = _SQL_INSERT.sub(lambda m: _scrub_sql_insert(m, counts), text)
    for kind, pattern in _PATTERNS:

        def sub(match: re.Match, kind: str = kind) -> str:
            if "REDACTED" in match.group(0) and kind in ("assigned_secret", "bearer_token"):
                return match.group(0)  # already scrubbed by a more specific pattern
            if (
                "bare" in match.re.groupindex
                and match.group("bare")
                and _is_code_reference(match.group("bare"))
            ):
                return match.group(0)
            counts[kind] = counts.get(kind, 0) + 1
            return _replace(kind, match)

        text = pattern.sub(sub, text)
    return text, counts


def _rand(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _secret(rng: random.Random, kind: str) -> str:
    up, hexd = string.ascii_uppercase + string.digits, "0123456789abcdef"
    return {
        "aws_access_key": lambda: "AKIA" + _rand(rng, 16, up),
        "aws_secret": lambda: _rand(rng, 40, string.ascii_letters + string.digits + "/+"),
        "github_token": lambda: "ghp_" + _rand(rng, 36),
        "openai_key": lambda: "sk-proj-" + _rand(rng, 40),
        "stripe_key": lambda: "sk_live_" + _rand(rng, 24),
        "slack_token": lambda: "xoxb-" + _rand(rng, 12, string.digits) + "-" + _rand(rng, 24),
        "google_api_key": lambda: "AIza" + _rand(rng, 35),
        "e2b_key": lambda: "e2b_" + _rand(rng, 40, hexd),
        "huggingface_token": lambda: "hf_" + _rand(rng, 34),
        "jwt": lambda: "eyJ" + _rand(rng, 20) + ".eyJ" + _rand(rng, 30) + "." + _rand(rng, 43),
        "password": lambda: _rand(
            rng, rng.randint(8, 20), string.ascii_letters + string.digits + "!#%&*"
        ),
        "private_key": lambda: (
            "-----BEGIN RSA PRIVATE KEY-----\n"
            + "\n".join(
                _rand(rng, 64, string.ascii_letters + string.digits + "+/") for _ in range(4)
            )
            + "\n-----END RSA PRIVATE KEY-----"
        ),
    }[kind]()


_CONTEXTS = {
    "aws_access_key": [
        'aws_access_key_id = "{s}"',
        "export AWS_ACCESS_KEY_ID={s}",
        "client = boto3.client('s3', aws_access_key_id='{s}')",
    ],
    "aws_secret": ['aws_secret_access_key = "{s}"', "AWS_SECRET_ACCESS_KEY={s}"],
    "github_token": [
        "git clone https://{s}@github.com/org/repo",
        'headers = {{"Authorization": "token {s}"}}',
        "GITHUB_TOKEN={s}",
    ],
    "openai_key": [
        'openai.api_key = "{s}"',
        "const client = new OpenAI({{ apiKey: '{s}' }});",
        "OPENAI_API_KEY={s}",
    ],
    "stripe_key": ["stripe.api_key = '{s}'", "const stripe = require('stripe')('{s}');"],
    "slack_token": ['slack = WebClient(token="{s}")', "SLACK_BOT_TOKEN={s}"],
    "google_api_key": [
        "fetch(`https://maps.googleapis.com/maps/api/geocode/json?key={s}`)",
        'GOOGLE_API_KEY = "{s}"',
    ],
    "e2b_key": ["E2B_API_KEY={s}", "sandbox = Sandbox(api_key='{s}')"],
    "huggingface_token": ['login(token="{s}")', "HF_TOKEN={s}"],
    "jwt": [
        "curl -H 'Authorization: Bearer {s}' https://api.example.com/v1/items",
        'session["jwt"] = "{s}"',
    ],
    "password": [
        'password = "{s}"',
        "conn = psycopg2.connect(host='db', user='app', password='{s}')",
        "postgres://app:{s}@db.internal:5432/prod",
        '{{"username": "admin", "password": "{s}"}}',
        "INSERT INTO users(name, password) VALUES ('bob', '{s}');",
        "DB_PASSWORD={s}",
    ],
    "private_key": ['key = """{s}"""', "{s}"],
}


def seeded_secrets(seed: int, n: int) -> list[tuple[str, str, str]]:
    """n (text, planted secret, kind) triples, reproducible for a seed."""
    rng = random.Random(seed)
    kinds = sorted(_CONTEXTS)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        secret = _secret(rng, kind)
        line = rng.choice(_CONTEXTS[kind]).format(s=secret)
        before = rng.choice(["", "import os\n", "# config\n", "x = 1\n", "const a = 2;\n"])
        out.append((before + line + "\n", secret, kind))
    return out


def recall(samples: list[tuple[str, str, str]]) -> float:
    """Share of planted secrets no longer present, even in part, after scrubbing."""
    caught = 0
    for text, secret, _ in samples:
        scrubbed, _ = scrub(text)
        core = secret.strip("-\n")[len(secret) // 4 : len(secret) // 4 + 12]  # a piece of it
        caught += secret not in scrubbed and core not in scrubbed
    return caught / len(samples) if samples else 1.0
