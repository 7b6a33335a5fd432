"""Credential formats of the held-out corpus, generated from each format's published shape.

Every generator follows what the issuer documents (or what public secret-scanning rule
sets record) about its tokens: prefix, alphabet, length, checksum. None of them was
written from the scrubber's patterns; the scrubber is measured against them.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import random
import string
import zlib
from collections.abc import Callable

ALNUM = string.ascii_letters + string.digits
URLSAFE = ALNUM + "-_"
HEX = "0123456789abcdef"
BASE32 = string.ascii_uppercase + "234567"


def pick(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def b64(rng: random.Random, n_bytes: int) -> str:
    return base64.b64encode(rng.randbytes(n_bytes)).decode()


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _base62(n: int) -> str:
    out = ""
    while n:
        n, r = divmod(n, 62)
        out = (string.digits + string.ascii_letters)[r] + out
    return out or "0"


def github_token(rng: random.Random, prefix: str) -> str:
    """GitHub's 2021 format: prefix, 30 random base62 chars, CRC32 of them in 6 base62."""
    body = pick(rng, ALNUM, 30)
    return f"{prefix}_{body}{_base62(zlib.crc32(body.encode())).rjust(6, '0')}"


def jwt(rng: random.Random) -> str:
    """An HS256 JSON Web Token (RFC 7519): base64url header, claims, HMAC-SHA256."""
    header = b64url(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    claims = {"sub": str(rng.randint(1, 10**6)), "iat": 1700000000 + rng.randint(0, 10**7)}
    claims["name"] = rng.choice(["ana", "bo", "chen", "dara"])
    payload = b64url(json.dumps(claims).encode())
    sig = hmac.new(rng.randbytes(32), f"{header}.{payload}".encode(), hashlib.sha256)
    return f"{header}.{payload}.{b64url(sig.digest())}"


def _der(rng: random.Random, size: int, prefix: bytes = b"") -> bytes:
    body = prefix + rng.randbytes(size - len(prefix))
    return b"\x30\x82" + len(body).to_bytes(2, "big") + body


def pem_private_key(rng: random.Random) -> str:
    """A PEM private key block (RFC 7468): PKCS#1 RSA, PKCS#8, SEC1 EC or OpenSSH."""
    label, der, width = rng.choice(
        [
            ("RSA PRIVATE KEY", _der(rng, 1190, b"\x02\x01\x00"), 64),
            ("PRIVATE KEY", _der(rng, 1214, b"\x02\x01\x000\r\x06\t*\x86H\x86\xf7\r"), 64),
            ("EC PRIVATE KEY", _der(rng, 117, b"\x02\x01\x01\x04 "), 64),
            ("OPENSSH PRIVATE KEY", b"openssh-key-v1\x00" + rng.randbytes(380), 70),
        ]
    )
    text = base64.b64encode(der).decode()
    lines = [text[i : i + width] for i in range(0, len(text), width)]
    return "\n".join([f"-----BEGIN {label}-----", *lines, f"-----END {label}-----"])


_WORDS = (
    "harbor violet copper falcon meadow pepper orbit canyon silver tundra maple zephyr "
    "lantern quartz ember willow cobalt saffron glacier puzzle"
).split()
PASSWORD_SYMBOLS = "!#%*-_.+=~^"


def human_password(rng: random.Random) -> str:
    """What people pick under a policy of 8+ chars with a digit (NIST SP 800-63B minimum 8)."""
    word = rng.choice(_WORDS)
    word = word.capitalize() if rng.random() < 0.5 else word
    if rng.random() < 0.3:
        word = word.replace("o", "0").replace("e", "3")
    return word + pick(rng, string.digits, rng.randint(2, 4)) + rng.choice(["", "!", "#", "*"])


def random_password(rng: random.Random) -> str:
    """What a password manager makes: 12-24 chars of letters, digits and symbols."""
    n = rng.randint(12, 24)
    while True:
        out = pick(rng, ALNUM + PASSWORD_SYMBOLS, n)
        if any(c.isdigit() for c in out) and any(c.isalpha() for c in out):
            return out


@dataclasses.dataclass(frozen=True)
class Format:
    """A credential format: how to make one, and the names code and configs give it."""

    name: str
    make: Callable[[random.Random], str]
    env: str  # the environment variable its issuer's docs use
    kwarg: str  # the keyword argument or config key its clients take
    # "token": recognisable by its shape anywhere; "opaque": only by where it stands
    family: str = "token"
    extra: tuple[str, ...] = ()  # context groups of its own (connection strings, headers)


FORMATS: tuple[Format, ...] = (
    Format(
        "aws_access_key_id",
        lambda r: "AKIA" + pick(r, BASE32, 16),
        "AWS_ACCESS_KEY_ID",
        "aws_access_key_id",
        extra=("aws_ini",),
    ),
    Format(
        "aws_secret_access_key",
        lambda r: pick(r, ALNUM + "/+", 40),
        "AWS_SECRET_ACCESS_KEY",
        "aws_secret_access_key",
        "opaque",
        ("aws_ini",),
    ),
    Format(
        "github_classic_token",
        lambda r: github_token(r, "ghp"),
        "GITHUB_TOKEN",
        "token",
        extra=("git_url",),
    ),
    Format("github_oauth_token", lambda r: github_token(r, "gho"), "GH_TOKEN", "token"),
    Format(
        "github_fine_grained_token",
        lambda r: "github_pat_" + pick(r, ALNUM, 22) + "_" + pick(r, ALNUM, 59),
        "GITHUB_TOKEN",
        "token",
        extra=("git_url",),
    ),
    Format(
        "gitlab_token",
        lambda r: "glpat-" + pick(r, URLSAFE, 20),
        "GITLAB_TOKEN",
        "private_token",
        extra=("git_url",),
    ),
    Format(
        "slack_bot_token",
        lambda r: (
            f"xoxb-{pick(r, string.digits, 12)}-{pick(r, string.digits, 13)}-{pick(r, ALNUM, 24)}"
        ),
        "SLACK_BOT_TOKEN",
        "token",
    ),
    Format(
        "slack_webhook",
        lambda r: (
            "https://hooks.slack.com/services/T"
            f"{pick(r, BASE32, 10)}/B{pick(r, BASE32, 10)}/{pick(r, ALNUM, 24)}"
        ),
        "SLACK_WEBHOOK_URL",
        "webhook_url",
    ),
    Format(
        "stripe_secret_key",
        lambda r: "sk_live_" + pick(r, ALNUM, r.choice([24, 99])),
        "STRIPE_SECRET_KEY",
        "api_key",
    ),
    Format(
        "stripe_restricted_key",
        lambda r: "rk_live_" + pick(r, ALNUM, r.choice([24, 99])),
        "STRIPE_API_KEY",
        "api_key",
    ),
    # Project and service-account keys: base64url halves around the marker; legacy user
    # keys: 20 + 20 alphanumerics (48 chars in all).
    Format(
        "openai_key",
        lambda r: (
            r.choice(["sk-proj-", "sk-svcacct-"])
            + pick(r, URLSAFE, 74)
            + "T3BlbkFJ"
            + pick(r, URLSAFE, 74)
            if r.random() < 0.7
            else "sk-" + pick(r, ALNUM, 20) + "T3BlbkFJ" + pick(r, ALNUM, 20)
        ),
        "OPENAI_API_KEY",
        "api_key",
    ),
    Format(
        "anthropic_key",
        lambda r: "sk-ant-api03-" + pick(r, URLSAFE, 93) + "AA",
        "ANTHROPIC_API_KEY",
        "api_key",
    ),
    Format("google_api_key", lambda r: "AIza" + pick(r, URLSAFE, 35), "GOOGLE_API_KEY", "key"),
    Format(
        "huggingface_token",
        lambda r: "hf_" + pick(r, string.ascii_letters, 34),
        "HF_TOKEN",
        "token",
    ),
    Format("e2b_api_key", lambda r: "e2b_" + pick(r, HEX, 40), "E2B_API_KEY", "api_key"),
    Format(
        "npm_token", lambda r: "npm_" + pick(r, ALNUM, 36), "NPM_TOKEN", "token", extra=("npmrc",)
    ),
    Format(
        "pypi_token",
        lambda r: "pypi-AgEIcHlwaS5vcmc" + b64url(r.randbytes(120)),
        "TWINE_PASSWORD",
        "password",
    ),
    Format(
        "sendgrid_key",
        lambda r: f"SG.{pick(r, URLSAFE, 22)}.{pick(r, URLSAFE, 43)}",
        "SENDGRID_API_KEY",
        "api_key",
    ),
    Format(
        "mailchimp_key",
        lambda r: pick(r, HEX, 32) + f"-us{r.randint(1, 21)}",
        "MAILCHIMP_API_KEY",
        "api_key",
    ),
    Format("jwt", jwt, "ACCESS_TOKEN", "access_token", extra=("bearer",)),
    Format("private_key", pem_private_key, "PRIVATE_KEY", "private_key", extra=("pem",)),
    Format("databricks_token", lambda r: "dapi" + pick(r, HEX, 32), "DATABRICKS_TOKEN", "token"),
    Format(
        "digitalocean_token", lambda r: "dop_v1_" + pick(r, HEX, 64), "DIGITALOCEAN_TOKEN", "token"
    ),
    Format(
        "shopify_token",
        lambda r: "shpat_" + pick(r, HEX, 32),
        "SHOPIFY_ACCESS_TOKEN",
        "access_token",
    ),
    Format(
        "telegram_bot_token",
        lambda r: f"{r.randint(10**8, 10**10 - 1)}:AA{pick(r, URLSAFE, 33)}",
        "TELEGRAM_BOT_TOKEN",
        "token",
    ),
    Format(
        "discord_bot_token",
        lambda r: (
            b64url(str(r.randint(10**17, 10**18)).encode())
            + f".{pick(r, URLSAFE, 6)}.{pick(r, URLSAFE, 27)}"
        ),
        "DISCORD_TOKEN",
        "token",
    ),
    Format(
        "square_access_token",
        lambda r: "EAAA" + pick(r, URLSAFE, 60),
        "SQUARE_ACCESS_TOKEN",
        "access_token",
    ),
    Format(
        "azure_storage_key",
        lambda r: b64(r, 64),
        "AZURE_STORAGE_KEY",
        "account_key",
        "opaque",
        ("azure_conn",),
    ),
    Format(
        "azure_sas_signature",
        lambda r: b64(r, 32).replace("+", "%2B").replace("/", "%2F").replace("=", "%3D"),
        "AZURE_SAS_TOKEN",
        "sas_token",
        "sas",
        ("azure_sas",),
    ),
    Format(
        "twilio_auth_token", lambda r: pick(r, HEX, 32), "TWILIO_AUTH_TOKEN", "auth_token", "opaque"
    ),
    Format(
        "bearer_token",
        lambda r: pick(r, URLSAFE + ".~", r.randint(32, 64)),
        "API_TOKEN",
        "token",
        "opaque",
        ("bearer",),
    ),
    Format(
        "basic_auth",
        lambda r: base64.b64encode(
            f"{r.choice(['admin', 'svc', 'ci-bot'])}:{random_password(r)}".encode()
        ).decode(),
        "BASIC_AUTH",
        "authorization",
        "header",
        ("basic",),
    ),
    Format("password_human", human_password, "DB_PASSWORD", "password", "password"),
    Format("password_random", random_password, "DB_PASSWORD", "password", "password"),
    Format(
        "duckdb_secret",
        lambda r: pick(r, ALNUM + "/+", 40),
        "S3_SECRET",
        "secret",
        "duckdb",
        ("duckdb",),
    ),
)
