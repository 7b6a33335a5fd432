"""Secret scrubbing: API keys, tokens, passwords and private keys become `<REDACTED:kind>`.

Everything that becomes training data passes through `scrub`. Three sets measure it (tests
and every build's manifest), so neither recall nor precision is assumed:
- `seeded_secrets`: planted secrets in the code, config and log lines the patterns were
  written for;
- `held_out_secrets`: forms real logs contain that those lines do not (Basic auth headers,
  short passwords on command lines and in env files, auth tuples, connection strings,
  GitLab/npm/SendGrid tokens, Slack webhooks);
- `CLEAN_LINES`: ordinary code that mentions passwords, tokens and keys without holding
  one (`password_hash(`, `token = tokenizer(x)`, `key=lambda`, tokenizer special tokens);
  every redaction there is a false positive.
"""

from __future__ import annotations

import base64
import random
import re
import string

_KEYWORD = (
    r"(?:passw(?:or)?d|(?<![a-z])pass|(?<=[_\-])pwd|passphrase|secret|token|credentials?"
    r"|api[_\-]?key|(?:access|secret|private|signing|encryption|master|account|client)[_\-]?key)"
    r"\d*(?:[_\-](?:value|base|b64|hex|raw))?"
)
_ENV_KEYWORD = (
    r"(?:[A-Z0-9]*PASSWORD|[A-Z0-9]*PASSWD|PASS|[A-Z0-9]*SECRET|[A-Z0-9]*TOKEN|CREDENTIALS?"
    r"|(?:API|ACCESS|PRIVATE|SECRET|ACCOUNT)_?KEY)"
)
# (kind, pattern). The secret is the group 'secret' (always redacted), or 'bare' (redacted
# unless it reads as a non-secret: a literal like true/None, a number, a type name, a
# tokenizer special token, or, for `assigned_secret`, a name in code), or the whole match.
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
        ("gitlab_token", r"\bgl(?:pat|dt|rt|cbt|ptt)-[A-Za-z0-9_\-]{20,}", 0),
        ("npm_token", r"\bnpm_[A-Za-z0-9]{36}\b", 0),
        ("openai_key", r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}\b", 0),
        ("stripe_key", r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}\b", 0),
        ("slack_token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b", 0),
        (
            "slack_webhook",
            r"hooks\.slack\.com/(?:services|workflows)/(?P<secret>[A-Za-z0-9_/\-]{20,})",
            0,
        ),
        ("sendgrid_key", r"\bSG\.[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,}", 0),
        ("google_api_key", r"\bAIza[0-9A-Za-z_\-]{35}\b", 0),
        ("e2b_key", r"\be2b_[0-9a-f]{30,}\b", 0),
        ("huggingface_token", r"\bhf_[A-Za-z0-9]{30,}\b", 0),
        ("jwt", r"\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\b", 0),
        (
            "azure_key",
            r"(?i)\b(?:AccountKey|SharedAccessKey|SharedAccessSignature)\s*=\s*"
            r"(?P<secret>[A-Za-z0-9+/%&:=._\-]{16,}?)(?=;|['\"\s]|$)",
            0,
        ),
        ("url_credentials", r"(?<=://)(?P<secret>[^\s:/@'\"]+:[^\s@/'\"]+)(?=@)", 0),
        (
            "basic_auth",
            r"(?i)\bauthorization\b['\"]?\s*[:=,]\s*['\"]?basic\s+"
            r"(?P<secret>[A-Za-z0-9+/]{6,}={0,2})",
            0,
        ),
        ("bearer_token", r"(?i)\b(?:bearer|token)\s+(?P<secret>[A-Za-z0-9_\-.=+/]{16,})", 0),
        # Command lines: mysql -pS3cret, --password=x, sshpass -p, redis-cli -a, curl -u u:pw.
        (
            "cli_password",
            r"\b(?:mysql|mysqldump|mysqladmin|mariadb)\b[^\n|;]*?\s-p['\"]?(?P<secret>[^\s'\"\-][^\s'\"]*)",
            0,
        ),
        (
            "cli_password",
            r"(?i)(?<!\S)--(?:[\w\-]*-)?pass(?:word)?(?:=|\s+)['\"]?(?P<secret>[^\s'\"$\-][^\s'\"]{2,})",
            0,
        ),
        (
            "cli_password",
            r"\b(?:sshpass\s+-p|redis-cli\b[^\n|;]*?\s-a|docker\s+login\b[^\n|;]*?\s-p)\s*['\"]?"
            r"(?P<secret>[^\s'\"$][^\s'\"]*)",
            0,
        ),
        (
            "cli_password",
            r"(?<!\S)(?:-u|--user)\s+['\"]?(?P<secret>[^\s:'\"$]+:[^\s'\"]+)",
            0,
        ),
        # auth=("user", "pw"), HTTPBasicAuth("user", "pw"), smtp.login(user, "pw")
        (
            "auth_pair",
            r"(?:\bauth\s*=\s*[(\[]|\b\w*(?:Basic|Digest|Proxy)Auth\s*\(|\.login\s*\()\s*"
            r"(?:b?['\"][^'\"\n]*['\"]|[\w.]+)\s*,\s*b?['\"](?P<secret>[^'\"\n]+)['\"]",
            0,
        ),
        (
            "query_secret",
            r"(?i)[?&;][\w\-]*(?:password|passwd|secret|token|api[_\-]?key|access[_\-]?key|sig)"
            r"=(?P<secret>[^&#\s'\"]{4,})",
            0,
        ),
        # PASSWORD=hunter2, export PGPASSWORD=x, -e MYSQL_ROOT_PASSWORD=x (env files, shells)
        (
            "env_secret",
            rf"\b(?:[A-Z0-9_]*_)?{_ENV_KEYWORD}=(?P<bare>[^\s'\"$`(){{}}\[\];&|,<>]{{3,}})",
            0,
        ),
        # password: hunter2 (YAML / config files): the value is the rest of the line
        (
            "config_secret",
            rf"(?im)^[ \t]*[\w\-.]*{_KEYWORD}[ \t]*:[ \t]+"
            r"(?P<bare>[^\s'\"#\[\](){},;|&*!%@`]+)[ \t]*$",
            0,
        ),
        (
            "assigned_secret",
            rf"(?i){_KEYWORD}['\"]?\s*(?::=|=>|[:=])\s*"
            r"(?:b?['\"`](?P<secret>[^'\"`\s]{3,})['\"`]|(?P<bare>[^\s'\"`,;()\[\]{}]{4,})"
            r"(?P<in_text>(?=['\"]|\s+[\w.\-]+=))?)",
            0,
        ),
    ]
]

_SQL_INSERT = re.compile(
    r"(?is)\binsert\s+into\s+[\w.\"`]+\s*\((?P<cols>[^)]*)\)\s*values\s*\((?P<vals>[^)]*)\)"
)
_SECRET_COLUMN = re.compile(r"(?i)pass|secret|token|api_?key|credential")
# Values that never are the secret itself.
_LITERALS = {"true", "false", "none", "null", "nil", "undefined", "yes", "no", "on", "off"}
_TYPE_NAMES = {"str", "string", "bytes", "int", "float", "bool", "number", "any", "object"}
_SPECIAL_TOKEN = re.compile(r"<[^<>]*>|\[[A-Za-z_]+\]")  # bos_token = "<s>", "[PAD]", "<|eot|>"
_NOT_SECRET = re.compile(r"\d+|[A-Z][a-z]+(?:[A-Z][a-z]+)*")  # a number, a type (SecretStr)
_CODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


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


def _plain_value(match: re.Match, kind: str) -> bool:
    """A value that is not a secret: a tokenizer's special token, or a bare literal, number,
    type, or name in code."""
    if match.group("bare") is None:
        return _SPECIAL_TOKEN.fullmatch(match.group("secret")) is not None
    value = match.group("bare")
    if (
        value.lower() in _LITERALS | _TYPE_NAMES
        or _NOT_SECRET.fullmatch(value)
        or _SPECIAL_TOKEN.fullmatch(value)
    ):
        return True
    # `token = self.token`, `password=pw2`: names in code, unless the match sits in a string
    # or a list of settings (`"host=db password=hunter2 dbname=x"`).
    return (
        kind == "assigned_secret"
        and match.group("in_text") is None
        and _CODE_NAME.fullmatch(value) is not None
    )


def _replace(kind: str, match: re.Match) -> str:
    for group in ("secret", "bare"):
        if group in match.re.groupindex and match.group(group) is not None:
            start, end = match.span(group)
            whole = match.group(0)
            base = match.start(0)
            return whole[: start - base] + f"<REDACTED:{kind}>" + whole[end - base :]
    return f"<REDACTED:{kind}>"


def _found(match: re.Match) -> str:
    for group in ("secret", "bare"):
        if group in match.re.groupindex and match.group(group) is not None:
            return match.group(group)
    return match.group(0)


def scrub(text: str) -> tuple[str, dict[str, int]]:
    """The text with every secret found replaced, and the count per kind."""
    counts: dict[str, int] = {}
    text = _SQL_INSERT.sub(lambda m: _scrub_sql_insert(m, counts), text)
    for kind, pattern in _PATTERNS:

        def sub(match: re.Match, kind: str = kind) -> str:
            if "REDACTED:" in _found(match):
                return match.group(0)  # already scrubbed by a more specific pattern
            if "bare" in match.re.groupindex and _plain_value(match, kind):
                return match.group(0)
            counts[kind] = counts.get(kind, 0) + 1
            return _replace(kind, match)

        text = pattern.sub(sub, text)
    return text, counts


def _rand(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


_WORDS = (
    "hunter dragon summer monkey shadow master welcome letmein secret admin qwerty winter "
    "spring sunshine football p4ss"
).split()


def _human_password(rng: random.Random) -> str:
    """A short password as people pick them: a word, digits, maybe a symbol (hunter2, S3cret!)."""
    word = rng.choice(_WORDS)
    word = word.capitalize() if rng.random() < 0.5 else word
    if rng.random() < 0.3:
        word = word.replace("e", "3").replace("a", "4")
    return word + _rand(rng, rng.randint(1, 4), string.digits) + rng.choice(["", "", "!", "#"])


def _secret(rng: random.Random, kind: str) -> str:
    up, hexd = string.ascii_uppercase + string.digits, "0123456789abcdef"
    alnum = string.ascii_letters + string.digits
    b64 = alnum + "+/"
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
        # held-out kinds
        "basic_auth": lambda: base64.b64encode(
            f"{rng.choice(['admin', 'svc', 'ci-bot'])}:{_human_password(rng)}".encode()
        ).decode(),
        "short_password": lambda: _human_password(rng),
        "azure_account_key": lambda: _rand(rng, 86, b64) + "==",
        "gitlab_token": lambda: "glpat-" + _rand(rng, 20, alnum + "_-"),
        "npm_token": lambda: "npm_" + _rand(rng, 36),
        "sendgrid_key": lambda: "SG." + _rand(rng, 22) + "." + _rand(rng, 43),
        "slack_webhook": lambda: f"T{_rand(rng, 8, up)}/B{_rand(rng, 8, up)}/{_rand(rng, 24)}",
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
# Forms seen in real execution logs, shell histories and config dumps that the seeded
# contexts above do not contain.
_HELD_OUT_CONTEXTS = {
    "basic_auth": [
        'curl -H "Authorization: Basic {s}" https://api.internal.example/v2/orders',
        'headers = {{"Authorization": "Basic {s}"}}',
        "> Authorization: Basic {s}",
    ],
    "short_password": [
        "PASSWORD={s}",
        "export PGPASSWORD={s}",
        "docker run -d -e MYSQL_ROOT_PASSWORD={s} mysql:8",
        "mysql -u root -p{s} -h 127.0.0.1 shop",
        "mysqldump --user=backup --password={s} shop > shop.sql",
        'r = requests.get(url, auth=("admin", "{s}"))',
        "r = requests.post(url, auth=HTTPBasicAuth('svc', '{s}'))",
        'server.login("alerts@example.com", "{s}")',
        'db = pymysql.connect(host="db", user="app", password="{s}")',
        "  password: {s}",
        "sshpass -p '{s}' ssh deploy@10.0.0.5 uptime",
        "redis-cli -h cache -a {s} ping",
        "curl -u admin:{s} https://ci.example.com/api/json",
        "GET /login?user=bob&password={s} HTTP/1.1",
        'conn = psycopg2.connect("host=db user=app password={s} dbname=shop")',
        "const pool = mysql.createPool({{ host: 'db', user: 'app', password: '{s}' }});",
    ],
    "azure_account_key": [
        "DefaultEndpointsProtocol=https;AccountName=prodlogs;AccountKey={s};"
        "EndpointSuffix=core.windows.net",
        'conn_str = "Endpoint=sb://bus.servicebus.windows.net/;'
        'SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey={s}"',
    ],
    "gitlab_token": [
        'curl --header "PRIVATE-TOKEN: {s}" https://gitlab.example.com/api/v4/projects',
        'gl = gitlab.Gitlab("https://gitlab.com", private_token="{s}")',
        "glab auth login --hostname gitlab.com --stdin <<< {s}",
    ],
    "npm_token": [
        "//registry.npmjs.org/:_authToken={s}",
        "npm config set //registry.npmjs.org/:_authToken {s}",
        "NODE_AUTH_TOKEN={s} npm publish",
    ],
    "sendgrid_key": ['sg = SendGridAPIClient("{s}")'],
    "slack_webhook": ['requests.post("https://hooks.slack.com/services/{s}", json=msg)'],
}
# Ordinary code and logs that mention passwords, tokens and keys but hold no secret.
CLEAN_LINES = [
    "hashed = password_hash($password, PASSWORD_DEFAULT);",
    "if (password_verify($input, $hashed)) { login($user); }",
    "token = tokenizer(x)",
    "tokens = tokenizer.encode(text, max_length=512, truncation=True)",
    "for token in tokens:",
    "pairs = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)",
    "auth = request.headers.get('Authorization')",
    'api_key = os.environ["OPENAI_API_KEY"]',
    "api_key = settings.API_KEY",
    "password = getpass.getpass()",
    'password = input("Password: ")',
    "if password == confirm_password:",
    "password_min_length = 12",
    "session_token_ttl_seconds = 86400000",
    "MAX_TOKENS=4096",
    "TOKENIZERS_PARALLELISM=false",
    "AUTH_ENABLED=true",
    "PWD=/home/runner/work/project",
    "OLDPWD=/tmp",
    'bos_token = "<s>"',
    'pad_token="[PAD]"',
    "tokenizer.pad_token = tokenizer.eos_token",
    'special = {"eos_token": "<|endoftext|>", "unk_token": "<unk>"}',
    "secret_len = len(secret)",
    "key = hashlib.sha256(data).hexdigest()",
    "token_hex = secrets.token_hex(16)",
    "password_field = forms.CharField(widget=forms.PasswordInput)",
    "def login(self, username: str, password: str) -> bool:",
    "    password: str",
    "    api_key: Optional[str] = None",
    "    password: SecretStr",
    "  password: string;",
    "const token = await getToken();",
    "const { password } = req.body;",
    "mysql -u root -p shop < dump.sql",
    "docker login -u me --password-stdin",
    'echo "$DB_PASSWORD" | docker login --username me --password-stdin',
    "SELECT id, password_hash FROM users WHERE email = ?;",
    "UPDATE users SET password_hash = ? WHERE id = ?;",
    "Basic authentication is described in RFC 7617.",
    "See https://example.com/docs/auth/tokens for details.",
    "git clone https://github.com/python/cpython.git",
    'token_type = "bearer"',
    'ssh-keygen -t ed25519 -C "me@example.com"',
    "credentials = service_account.Credentials.from_service_account_file(path)",
    "session_token = None",
    "TOKEN_LIMIT=2048",
    "r = requests.get(url, auth=auth, timeout=5)",
    "r = requests.get(url, auth=(user, password))",
    "smtp.login(user, password)",
    '<input type="password" name="password" autocomplete="current-password">',
    'password_reset_url = reverse("password_reset")',
    'PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]',
    "model.generate(input_ids, max_new_tokens=256)",
    "num_tokens: 128",
    '"access_token": access_token,',
    'conn = connect(password=os.environ.get("DB_PASSWORD"), user=user)',
    "db.connect(user=user, password=pw2)",
    "client = Client(token=None)",
    'parser.add_argument("--password", help="the database password")',
    "--password-file /run/secrets/db",
    "export API_KEY=$(cat /run/secrets/api_key)",
    "password_hash VARCHAR(255) NOT NULL,",
    "  token: ${{ secrets.GITHUB_TOKEN }}",
    "Authorization: Bearer <token>",
    "token: `Basic ${Buffer.from(user + ':' + pass).toString('base64')}`",
    "KeyError: 'token'",
    ">>> secrets.token_urlsafe(16)",
]


def _planted(contexts: dict[str, list[str]], seed: int, n: int) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    kinds = sorted(contexts)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        secret = _secret(rng, kind)
        line = rng.choice(contexts[kind]).format(s=secret)
        before = rng.choice(["", "import os\n", "# config\n", "x = 1\n", "const a = 2;\n"])
        out.append((before + line + "\n", secret, kind))
    return out


def seeded_secrets(seed: int, n: int) -> list[tuple[str, str, str]]:
    """n (text, planted secret, kind) triples in the seeded contexts, reproducible for a seed."""
    return _planted(_CONTEXTS, seed, n)


def held_out_secrets(seed: int, n: int) -> list[tuple[str, str, str]]:
    """n (text, planted secret, kind) triples in the held-out real-log forms."""
    return _planted(_HELD_OUT_CONTEXTS, seed, n)


def _caught(text: str, secret: str) -> tuple[bool, int]:
    """Whether no piece of the secret is left after scrubbing, and how many redactions."""
    scrubbed, counts = scrub(text)
    core = secret.strip("-\n")[len(secret) // 4 : len(secret) // 4 + 12]  # a piece of it
    return secret not in scrubbed and core not in scrubbed, sum(counts.values())


def recall(samples: list[tuple[str, str, str]]) -> float:
    """Share of planted secrets no longer present, even in part, after scrubbing."""
    caught = sum(_caught(text, secret)[0] for text, secret, _ in samples)
    return caught / len(samples) if samples else 1.0


def evaluate(seed: int, samples: int) -> dict:
    """Recall on the seeded and held-out sets, precision over them and the clean lines.

    Precision counts a redaction as true when it removed a planted secret (one per caught
    secret); any other redaction, in a planted text or a clean line, is false.
    """
    planted = {"seeded": seeded_secrets(seed, samples), "held_out": held_out_secrets(seed, samples)}
    true_pos = false_pos = 0
    report: dict = {}
    for name, items in planted.items():
        caught = [_caught(text, secret) for text, secret, _ in items]
        report[f"recall_{name}"] = round(sum(c for c, _ in caught) / len(items), 4)
        true_pos += sum(c for c, _ in caught)
        false_pos += sum(n - c for c, n in caught)
    altered = [line for line in CLEAN_LINES if scrub(line)[0] != line]
    false_pos += sum(sum(scrub(line)[1].values()) for line in altered)
    report["precision"] = round(true_pos / max(1, true_pos + false_pos), 4)
    report["clean_lines"] = len(CLEAN_LINES)
    report["clean_lines_altered"] = len(altered)
    return report
