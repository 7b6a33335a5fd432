"""The generated corpus: credentials of formats nobody named, in the contexts of
grammar.py and layouts.py, and the values that must survive in the same contexts.

Positives are drawn from contexts x random alphabets x structures (tokens.py), never from
the detector's patterns; negatives put hashes, UUIDs, ids and base64 payloads in the same
contexts without a credential cue, and references, placeholders, publishable and public
keys under one. Leave-one-family-out takes each provider's tokens (credential_formats.py, made from
the issuers' published shapes), removes that provider's format rule and every mention of
it from the detector, and measures recall in every context.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import random
import urllib.parse
from collections import Counter, defaultdict

from capibara_exp.data.e2b import scrub
from capibara_exp.data.e2b.heldout import caught, grammar, layouts, tokens
from capibara_exp.data.e2b.heldout.credential_formats import FORMATS

CODE_CHANNELS = frozenset({"python", "javascript", "typescript", "java", "r", "bash", "sql", "go"})
# Provider tokens of credential_formats.py by the detector's family (formats.FAMILIES).
FAMILY_OF = {
    "aws_access_key_id": "aws",
    "aws_secret_access_key": "aws",
    "github_classic_token": "github",
    "github_oauth_token": "github",
    "github_fine_grained_token": "github",
    "gitlab_token": "gitlab",
    "slack_bot_token": "slack",
    "slack_webhook": "slack",
    "stripe_secret_key": "stripe",
    "stripe_restricted_key": "stripe",
    "openai_key": "openai",
    "anthropic_key": "anthropic",
    "google_api_key": "google",
    "huggingface_token": "huggingface",
    "e2b_api_key": "e2b",
    "npm_token": "npm",
    "pypi_token": "pypi",
    "sendgrid_key": "sendgrid",
    "mailchimp_key": "mailchimp",
    "jwt": "jwt",
    "private_key": "private_key",
    "databricks_token": "databricks",
    "digitalocean_token": "digitalocean",
    "shopify_token": "shopify",
    "telegram_bot_token": "telegram",
    "discord_bot_token": "discord",
    "square_access_token": "square",
    "azure_storage_key": "azure",
    "azure_sas_signature": "azure",
    "twilio_auth_token": "twilio",
}
REFERENCES = (
    'os.environ["{K}"]',
    'os.getenv("{K}")',
    "process.env.{K}",
    'Sys.getenv("{K}")',
    'System.getenv("{K}")',
    "${K}",
    "${{{{ secrets.{K} }}}}",
    "{{{{ .Values.{k} }}}}",
)
PLACEHOLDERS = (
    "<YOUR_TOKEN>",
    "YOUR_API_KEY",
    "xxxxxxxxxxxxxxxx",
    "********",
    "<token>",
    "REPLACE_ME",
    "your-key-here",
    "changeme",
    "sk-...",
)


@dataclasses.dataclass(frozen=True)
class Sample:
    cls: str
    fmt: str
    channel: str
    text: str
    planted: str


def _fill(ctx: grammar.Context, rng: random.Random, value: str, words, neutral: bool) -> str:
    v = tokens.vendor(rng)
    text = ctx.neutral if (neutral and ctx.neutral) else ctx.text
    style = rng.choice(ctx.styles) if ctx.styles else "snake"
    return text.format(k=tokens.render(words, style), s=value, v=v, V=v.capitalize())


def _token_value(rng: random.Random) -> tuple[str, str]:
    alphabet, structure = rng.choice(sorted(tokens.ALPHABETS)), rng.choice(tokens.STRUCTURES)
    return f"{structure}/{alphabet}", tokens.token(rng, alphabet, structure)


def _one(rng: random.Random, value_for) -> Sample:
    """One positive: a context drawn over classes (tables and key blocks among them)."""
    cls = rng.choice(sorted({c.cls for c in grammar.CONTEXTS} | {"table", "key_block"}))
    if cls == "key_block":
        block = layouts.key_block(rng)
        channel, text, planted = layouts.key_context(
            rng, block, rng.choice(["private_key", "key", "pem"])
        )
        return Sample(cls, "key_block", channel, text, planted)
    fmt, value = value_for(rng, "token")
    if cls == "table":
        slot = rng.choice(["token", "chosen"])
        fmt, value = value_for(rng, slot)
        nouns = tokens.GENERATED_NOUNS if slot == "token" else tokens.CHOSEN_NOUNS
        words = tokens.key_words(rng, nouns)
        channel, text = layouts.table(
            rng, tokens.render(words, rng.choice(["snake", "camel", "flat"])), value
        )
        return Sample(cls, fmt, channel, text, value)
    ctx = rng.choice([c for c in grammar.CONTEXTS if c.cls == cls])
    if ctx.slot == "chosen":
        fmt, value = value_for(rng, "chosen")
    if cls == "url":  # in a URL a credential is percent-encoded, as clients write it
        value = urllib.parse.quote(value, safe="")
    nouns = tokens.CHOSEN_NOUNS if ctx.slot == "chosen" else tokens.GENERATED_NOUNS
    return Sample(
        cls, fmt, ctx.channel, _fill(ctx, rng, value, tokens.key_words(rng, nouns), False), value
    )


def _never_named(rng: random.Random, slot: str) -> tuple[str, str]:
    if slot == "chosen":
        return "password", tokens.password(rng)
    return _token_value(rng)


def positives(seed: int, n: int) -> list[Sample]:
    rng = random.Random(seed)
    return [_one(rng, _never_named) for _ in range(n)]


def scrubbed(channel: str, text: str, exclude=frozenset()) -> str:
    language = channel if channel in CODE_CHANNELS else None
    return scrub.scrub_text(text, language, exclude=exclude)[0]


def _neutral_one(rng: random.Random) -> tuple[str, str, str]:
    """(category, channel, text): a hash, UUID, id or payload in a context without a cue."""
    category, value = tokens.neutral_value(rng)
    if rng.random() < 0.15:
        cols_name = tokens.render(rng.choice(tokens.NEUTRAL_NOUNS), "snake")
        channel, text = layouts.table(rng, cols_name, value)
        return f"no_cue_{category}", channel, text
    ctx = rng.choice([c for c in grammar.CONTEXTS if c.slot == "token"])
    words = rng.choice(tokens.NEUTRAL_NOUNS)
    return f"no_cue_{category}", ctx.channel, _fill(ctx, rng, value, words, True)


def _kept_under_cue(rng: random.Random) -> tuple[str, str, str]:
    """(category, channel, text): a reference, placeholder, publishable or public key under
    a credential name."""
    ctx = rng.choice([c for c in grammar.CONTEXTS if "{k}" in c.text and c.slot == "token"])
    words = tokens.key_words(rng, tokens.GENERATED_NOUNS)
    key = tokens.render(words, "screaming")
    category = rng.choice(["reference", "placeholder", "publishable", "public_key", "image"])
    if category == "reference":
        value = rng.choice(REFERENCES).format(K=key, k=key.lower())
    elif category == "placeholder":
        value = rng.choice(PLACEHOLDERS)
    elif category == "publishable":
        value = rng.choice(["pk_live_", "pk_test_"]) + tokens.pick(
            rng, tokens.ALPHABETS["base62"], 24
        )
    elif category == "public_key":
        body = base64.b64encode(
            b"\x00\x00\x00\x0bssh-ed25519\x00\x00\x00 " + rng.randbytes(32)
        ).decode()
        value = f"ssh-ed25519 {body} deploy@{tokens.vendor(rng)}"
    else:
        png = b"\x89PNG\r\n\x1a\n" + rng.randbytes(rng.randint(300, 800))
        value = "data:image/png;base64," + base64.b64encode(png).decode()
    return category, ctx.channel, _fill(ctx, rng, value, words, False)


def negatives(seed: int, n: int) -> list[tuple[str, str, str]]:
    rng = random.Random(seed + 1)
    return [_neutral_one(rng) if rng.random() < 0.6 else _kept_under_cue(rng) for _ in range(n)]


def _rate(hits: Counter, totals: Counter) -> dict[str, float]:
    return {k: round(hits[k] / totals[k], 4) for k in sorted(totals)}


@functools.cache
def evaluate(seed: int, n_positives: int, n_negatives: int) -> dict:
    """Recall per context class, format and channel on never-named formats; negatives altered."""
    hits: dict[str, Counter] = defaultdict(Counter)
    totals: dict[str, Counter] = defaultdict(Counter)
    missed = []
    for p in positives(seed, n_positives):
        ok = caught(scrubbed(p.channel, p.text), p.planted)
        for axis, key in (("class", p.cls), ("format", p.fmt), ("channel", p.channel)):
            totals[axis][key] += 1
            hits[axis][key] += ok
        if not ok:
            missed.append(p)
    altered, per_category = Counter(), Counter()
    examples = []
    for category, channel, text in negatives(seed, n_negatives):
        per_category[category] += 1
        if (out := scrubbed(channel, text)) != text:
            altered[category] += 1
            examples.append((category, text, out))
    n_pos = sum(totals["class"].values())
    return {
        "positives": n_pos,
        "recall": round(sum(hits["class"].values()) / max(1, n_pos), 4),
        "recall_per_class": _rate(hits["class"], totals["class"]),
        "recall_per_format": _rate(hits["format"], totals["format"]),
        "recall_per_channel": _rate(hits["channel"], totals["channel"]),
        "negatives": sum(per_category.values()),
        "negatives_per_category": dict(sorted(per_category.items())),
        "negatives_altered": dict(sorted(altered.items())),
        "negatives_altered_share": round(sum(altered.values()) / max(1, n_negatives), 4),
        "missed": missed,
        "altered_examples": examples,
    }


def _provider_value(fmt_name: str):
    fmt = next(f for f in FORMATS if f.name == fmt_name)

    def value_for(rng: random.Random, slot: str) -> tuple[str, str]:
        return fmt_name, fmt.make(rng)

    return value_for


def _family_sample(rng: random.Random, fmt_name: str) -> Sample:
    if fmt_name == "private_key":
        block = next(f for f in FORMATS if f.name == fmt_name).make(rng)
        channel, text, planted = layouts.key_context(rng, block, "private_key")
        return Sample("key_block", fmt_name, channel, text, planted)
    sample = _one(rng, _provider_value(fmt_name))
    while sample.cls == "key_block":
        sample = _one(rng, _provider_value(fmt_name))
    return sample


@functools.cache
def leave_one_family_out(seed: int, per_family: int) -> dict:
    """Recall on each provider family's tokens in every context, with that family's format
    rules (and every mention of it) removed from the detector; the worst family."""
    rng = random.Random(seed + 2)
    by_family: dict[str, list[str]] = defaultdict(list)
    for fmt_name, family in FAMILY_OF.items():
        by_family[family].append(fmt_name)
    recall, per_class, missed = {}, defaultdict(Counter), []
    for family, fmt_names in sorted(by_family.items()):
        hits = 0
        for i in range(per_family):
            s = _family_sample(rng, fmt_names[i % len(fmt_names)])
            ok = caught(scrubbed(s.channel, s.text, frozenset({family})), s.planted)
            hits += ok
            per_class[s.cls]["n"] += 1
            per_class[s.cls]["hits"] += ok
            if not ok:
                missed.append((family, s))
        recall[family] = round(hits / per_family, 4)
    worst = min(recall, key=recall.get)
    return {
        "families": len(recall),
        "per_family": per_family,
        "recall": recall,
        "worst_family": worst,
        "worst_recall": recall[worst],
        "recall_per_class": {c: round(v["hits"] / v["n"], 4) for c, v in sorted(per_class.items())},
        "missed": missed,
    }
