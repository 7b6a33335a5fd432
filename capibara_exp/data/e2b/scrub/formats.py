"""Provider formats: one more signal, never the main one.

Each family is one issuer's formats: the detect-secrets plugins that know them (Yelp's
library, kept up to date by security teams) and the few regexes the project adds where
detect-secrets has none, plus what the issuer documents as public (Stripe's publishable
`pk_` keys). A family can be left out (`exclude`): the evaluation removes one family at a
time, with every mention of it, and measures what the context detector still catches.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.plugins.base import RegexBasedDetector

# detect-secrets plugins not used: the two high-entropy ones flag every hash, digest and
# base64 image outputs are full of (the shape test replaces them, with a cue); public
# IPv4 addresses are not credentials; the keyword detector is replaced by the project's
# cue detector, which reads more languages, cases and forms.
LEFT_OUT = frozenset(
    {"Base64 High Entropy String", "Hex High Entropy String", "Public IP (ipv4)", "Secret Keyword"}
)
# The file name detect-secrets picks its per-language regexes by.
_FILE = "cell.py"
# A regex plugin reports its first group, for some (GitHub's) only the prefix (`ghp`):
# the token is widened over these characters and must match the plugin again.
_TOKEN = re.compile(r"[A-Za-z0-9_\-]")
_WINDOW, _OVERLAP = 4096, 512


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    plugins: tuple[str, ...] = ()  # detect-secrets secret types
    regexes: tuple[str, ...] = ()  # the project's, where detect-secrets has none
    public: tuple[str, ...] = ()  # prefixes of keys the issuer marks public


FAMILIES: tuple[Family, ...] = (
    Family("aws", ("AWS Access Key",)),
    Family("github", ("GitHub Token",), (r"\bgithub_pat_[A-Za-z0-9_]{60,}",)),
    Family("gitlab", ("GitLab Token",)),
    Family("slack", ("Slack Token",)),
    Family(
        "stripe",
        ("Stripe Access Key",),
        (r"\b[rs]k_(?:live|test)_[0-9A-Za-z]{20,}",),
        ("pk_live_", "pk_test_"),
    ),
    Family("openai", ("OpenAI Token",), (r"\bsk-(?:proj|svcacct|admin)-[A-Za-z0-9_\-]{40,}",)),
    Family("anthropic", (), (r"\bsk-ant-(?:api|admin)\d\d-[A-Za-z0-9_\-]{80,}",)),
    Family("google", (), (r"\bAIza[0-9A-Za-z_\-]{35}",)),
    Family("huggingface", (), (r"\bhf_[A-Za-z0-9]{30,}",)),
    Family("e2b", (), (r"\be2b_[0-9a-f]{30,}",)),
    Family("npm", ("NPM tokens",), (r"\bnpm_[A-Za-z0-9]{36}",)),
    Family("pypi", ("PyPI Token",)),
    Family("sendgrid", ("SendGrid API Key",)),
    Family("mailchimp", ("Mailchimp Access Key",)),
    Family("jwt", ("JSON Web Token",)),
    Family("private_key", ("Private Key",)),
    Family("databricks", (), (r"\bdapi[0-9a-f]{32}",)),
    Family("digitalocean", (), (r"\bdo[por]_v1_[0-9a-f]{64}",)),
    Family("shopify", (), (r"\bshp(?:at|ca|pa|ss)_[0-9a-fA-F]{32}",)),
    Family("telegram", ("Telegram Bot Token",)),
    Family("discord", ("Discord Bot Token",)),
    Family(
        "square", ("Square OAuth Secret",), (r"\bEAAA[A-Za-z0-9_\-]{60}", r"\bsq0atp-[\w\-]{22}")
    ),
    Family("azure", ("Azure Storage Account access key",)),
    Family("twilio", ("Twilio API Key",)),
    Family("artifactory", ("Artifactory Credentials",)),
    Family(
        "ibm",
        (
            "IBM Cloud IAM Key",
            "IBM COS HMAC Credentials",
            "SoftLayer Credentials",
            "Cloudant Credentials",
        ),
    ),
    Family("url_credentials", ("Basic Auth Credentials",)),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


def slug(secret_type: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", secret_type.lower()).strip("_")


@functools.cache
def _active(exclude: frozenset[str]) -> tuple[tuple, tuple, tuple[str, ...]]:
    """(plugins as (kind, instance), regexes as (kind, compiled), public prefixes)."""
    unknown = exclude - set(FAMILY_NAMES)
    if unknown:
        raise ValueError(f"unknown format families {sorted(unknown)} (known: {FAMILY_NAMES})")
    found = get_mapping_from_secret_type_to_class()
    plugins, regexes, public = [], [], []
    for fam in FAMILIES:
        if fam.name in exclude:
            continue
        plugins += [(slug(t), found[t]()) for t in fam.plugins if t not in LEFT_OUT]
        regexes += [(f"{fam.name}_token", r + r"(?![\w\-])") for r in fam.regexes]
        public += fam.public
    combined = re.compile("|".join(f"(?P<g{i}>{r})" for i, (_, r) in enumerate(regexes)) or "(?!)")
    return tuple(plugins), (combined, tuple(k for k, _ in regexes)), tuple(public)


def plugin_names(exclude: frozenset[str] = frozenset()) -> list[str]:
    """The detect-secrets plugins in use (for the manifest)."""
    return sorted({type(p).__name__ for _, p in _active(exclude)[0]})


def public(value: str, exclude: frozenset[str] = frozenset()) -> bool:
    """A key its issuer marks public (Stripe's publishable keys)."""
    return value.startswith(_active(exclude)[2])


def _windows(line: str):
    if len(line) <= _WINDOW:
        yield line
        return
    for start in range(0, len(line), _WINDOW - _OVERLAP):
        yield line[start : start + _WINDOW]


def widen(text: str, lo: int, hi: int) -> tuple[int, int]:
    """A span widened over token characters on both sides."""
    while lo > 0 and _TOKEN.match(text[lo - 1]):
        lo -= 1
    while hi < len(text) and _TOKEN.match(text[hi]):
        hi += 1
    return lo, hi


def plugin_spans(line: str, plugins) -> list[tuple[int, int, str]]:
    out = []
    for window_start, window in enumerate(_windows(line)):
        offset = window_start * (_WINDOW - _OVERLAP)
        for kind, plugin in plugins:
            for found in plugin.analyze_line(filename=_FILE, line=window):
                value = found.secret_value
                at = window.find(value) if value else -1
                while at != -1:
                    lo, hi = widen(line, offset + at, offset + at + len(value))
                    token = line[lo:hi]
                    prefix_only = len(value) < 8 and isinstance(plugin, RegexBasedDetector)
                    if not prefix_only or any(r.search(token) for r in plugin.denylist):
                        out.append((lo, hi, kind))
                    at = window.find(value, at + len(value))
    return out


def spans(line: str, exclude: frozenset[str] = frozenset()) -> list[tuple[int, int, str]]:
    """(start, end, kind) of provider-format tokens in one line (not yet checked by keep)."""
    plugins, (combined, kinds), _ = _active(exclude)
    out = plugin_spans(line, plugins)
    for m in combined.finditer(line):
        out.append((m.start(), m.end(), kinds[int(m.lastgroup[1:])]))
    return out
