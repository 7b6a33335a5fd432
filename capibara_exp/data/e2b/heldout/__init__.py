"""What measures secret scrubbing. Here, the provider formats' held-out corpus.

Positives: every credential format of credential_formats.py, made from its published shape, placed
in the contexts of log_contexts.py (code, SQL DML and DDL, shell, env/INI/YAML settings,
URLs, stdout, stderr, tracebacks, error values). Negatives: text harvested from this
machine's files (negatives.py) that must come out unchanged. This corpus was written
beside the old patterns and scores 1.000: it is kept, not relied on. What the detector
cannot have seen is in generated.py (formats nobody named, in generated contexts, and
each provider family left out). The goals (recall >= 0.99 per secret, <= 2% of the
negatives altered) are checked by the build's gate (build.check_scrubbing) and printed by
bench/scrubbing.py.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import Counter, defaultdict

from capibara_exp.data.e2b import scrub
from capibara_exp.data.e2b.heldout import log_contexts, negatives
from capibara_exp.data.e2b.heldout.credential_formats import FORMATS

# Record fields that hold code, and their language (the scrubber reads code differently).
_CODE = {"python": "python", "javascript": "javascript", "sql": "sql"}
# Negatives per harvested category.
NEGATIVES_PER_CATEGORY = {
    "record_hashes": 60,
    "hex_digests": 60,
    "uuids": 60,
    "base64_images": 40,
    "identifiers": 100,
    "word_literals": 40,
    "package_urls": 40,
    "placeholders": 64,
    "fixtures": 40,
    "arns": 24,
}


@dataclasses.dataclass(frozen=True)
class Positive:
    kind: str
    channel: str
    text: str
    planted: str


def positives(seed: int, per_kind: int) -> list[Positive]:
    rng = random.Random(seed)
    out = []
    for fmt in FORMATS:
        for _ in range(per_kind):
            text, channel, planted = log_contexts.place(fmt, fmt.make(rng), rng)
            out.append(Positive(fmt.name, channel, text, planted))
    return out


@functools.cache
def negative_samples(seed: int) -> tuple[dict[str, list[tuple[str, str]]], dict]:
    """{category: [(channel, text)]} and where they came from (harvested counts)."""
    rng = random.Random(seed)
    n = NEGATIVES_PER_CATEGORY
    uuids, harvested_uuids = negatives.uuid_lines(rng, n["uuids"])
    samples = {
        "record_hashes": negatives.record_lines(rng, n["record_hashes"]),
        "hex_digests": negatives.hex_digests(rng, n["hex_digests"]),
        "uuids": uuids,
        "base64_images": negatives.image_uris(rng, n["base64_images"]),
        "identifiers": negatives.identifier_lines(rng, n["identifiers"]),
        "word_literals": negatives.word_literal_lines(rng, n["word_literals"]),
        "package_urls": negatives.metadata_lines(rng, n["package_urls"]),
        "placeholders": negatives.placeholder_lines(rng, n["placeholders"]),
        "fixtures": negatives.fixture_lines(rng, n["fixtures"]),
        "arns": negatives.arn_lines(rng, n["arns"]),
    }
    return samples, {"uuids_harvested": harvested_uuids}


def caught(scrubbed: str, planted: str) -> bool:
    """No piece of the credential is left: not whole, nor a 12-char piece of its middle or end."""
    pieces = {planted}
    if len(planted) >= 24:
        third = len(planted) // 3
        pieces |= {planted[third : third + 12], planted[-12:]}
    return not any(p in scrubbed for p in pieces)


def _scrub(channel: str, text: str, own: bool = True) -> str:
    return scrub.scrub_text(text, _CODE.get(channel), own)[0]


@functools.cache
def evaluate(seed: int, per_kind: int, own: bool = True) -> dict:
    """Recall per credential format and negatives altered per category (cached: the corpus
    and the scrubber are fixed within a process); `own=False`: detect-secrets alone."""
    hits, totals, missed = Counter(), Counter(), defaultdict(list)
    for p in positives(seed, per_kind):
        totals[p.kind] += 1
        if caught(_scrub(p.channel, p.text, own), p.planted):
            hits[p.kind] += 1
        else:
            missed[p.kind].append(p.channel)
    samples, sources = negative_samples(seed)
    altered = {
        cat: sum(_scrub(ch, text, own) != text for ch, text in items)
        for cat, items in samples.items()
    }
    n_neg = sum(len(items) for items in samples.values())
    recall = {k: round(hits[k] / totals[k], 4) for k in sorted(totals)}
    return {
        "formats": len(recall),
        "positives": sum(totals.values()),
        "recall": recall,
        "min_recall": min(recall.values()),
        "missed_channels": {k: dict(Counter(v)) for k, v in sorted(missed.items())},
        "negatives": n_neg,
        "negatives_per_category": {c: len(items) for c, items in samples.items()},
        "negatives_altered": altered,
        "negatives_altered_share": round(sum(altered.values()) / max(1, n_neg), 4),
        "negative_sources": sources,
        "plugins": scrub.plugin_names(),
    }


def altered_negatives(seed: int) -> list[tuple[str, str, str]]:
    """(category, text, scrubbed) of every altered negative: what the benchmark shows."""
    samples, _ = negative_samples(seed)
    return [
        (cat, text, _scrub(ch, text))
        for cat, items in samples.items()
        for ch, text in items
        if _scrub(ch, text) != text
    ]


def missed_positives(seed: int, per_kind: int) -> list[tuple[str, str, str]]:
    """(kind, text, scrubbed) of every credential left in place (synthetic, never real)."""
    return [
        (p.kind, p.text, s)
        for p in positives(seed, per_kind)
        if not caught(s := _scrub(p.channel, p.text), p.planted)
    ]
