"""Values for the generated corpus: credentials of formats nobody named, the names that
hold them, and the values that must survive.

A never-named format is drawn, not written: an alphabet (hex, base32, base62, base64,
URL-safe base64, letters, lower-case alphanumerics, upper-case alphanumerics), a length
(20 to 64), and a structure (bare, a made-up vendor prefix, dotted parts, built around a
UUID). Vendor words are random syllables, so no provider the detector could know stands in
them. Key names combine a vendor word, a credential noun (English and other languages)
and a case style.
"""

from __future__ import annotations

import base64
import random
import re
import string
import uuid

from capibara_exp.data.e2b.heldout.credential_formats import human_password, random_password

ALPHABETS = {
    "hex": "0123456789abcdef",
    "HEX": "0123456789ABCDEF",
    "base32": string.ascii_uppercase + "234567",
    "base62": string.ascii_letters + string.digits,
    "base64": string.ascii_letters + string.digits + "+/",
    "base64url": string.ascii_letters + string.digits + "-_",
    "letters": string.ascii_letters,
    "lower_alnum": string.ascii_lowercase + string.digits,
    "upper_alnum": string.ascii_uppercase + string.digits,
}
STRUCTURES = ("bare", "prefixed", "dotted", "uuid_built")
UUID_ONLY = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_CONSONANTS, _VOWELS = "bcdfghjklmnprstvwxz", "aeiou"


def pick(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def vendor(rng: random.Random) -> str:
    """A made-up vendor word: 2-3 random syllables (`zorbla`, `quenti`)."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))


def token(rng: random.Random, alphabet: str, structure: str) -> str:
    """A credential of a never-named format."""
    chars = ALPHABETS[alphabet]
    if structure == "bare":
        return pick(rng, chars, rng.randint(20, 64))
    if structure == "prefixed":
        mid = rng.choice(
            ["", "live_", "prod_", "sk_", f"{pick(rng, 'abcdefghijklmnopqrstuvwxyz', 2)}_"]
        )
        head = vendor(rng)[: rng.randint(2, 5)] + rng.choice("_-")
        return f"{head}{mid}{pick(rng, chars, rng.randint(20, 56))}"
    if structure == "dotted":
        parts = [pick(rng, chars, rng.randint(8, 40)) for _ in range(rng.randint(2, 3))]
        return ".".join(parts)
    u = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return rng.choice(
        [
            f"{vendor(rng)[:4]}_{u}",
            f"{vendor(rng)[:3]}-{u.replace('-', '')}",
            f"{u}.{pick(rng, chars, rng.randint(16, 32))}",
            f"{u}:{uuid.UUID(int=rng.getrandbits(128), version=4)}",
            u,
        ]
    )


def password(rng: random.Random) -> str:
    return human_password(rng) if rng.random() < 0.5 else random_password(rng)


# Credential nouns: (words, rule). Chosen secrets hold any value; the rest are generated.
GENERATED_NOUNS = [
    ["api", "key"],
    ["api", "token"],
    ["access", "token"],
    ["auth", "token"],
    ["token"],
    ["secret", "key"],
    ["private", "token"],
    ["access", "key"],
    ["bearer", "token"],
    ["refresh", "token"],
    ["session", "token"],
    ["signing", "key"],
    ["license", "key"],
    ["credential"],
    ["apikey"],
    ["authtoken"],
    ["key"],
    ["app", "key"],
    ["master", "key"],
    ["service", "key"],
    ["jeton"],
    ["chave", "api"],
    ["schlüssel"],
    ["clé", "api"],
    ["токен"],
]
CHOSEN_NOUNS = [
    ["password"],
    ["passwd"],
    ["pwd"],
    ["passphrase"],
    ["db", "password"],
    ["secret"],
    ["admin", "password"],
    ["client", "secret"],
    ["webhook", "secret"],
    ["passwort"],
    ["contraseña"],
    ["mot", "de", "passe"],
    ["senha"],
    ["пароль"],
    ["root", "password"],
]
# Names of values that are not credentials (the negatives' names).
NEUTRAL_NOUNS = [
    ["request", "id"],
    ["trace", "id"],
    ["commit"],
    ["sha256"],
    ["checksum"],
    ["etag"],
    ["digest"],
    ["build", "id"],
    ["image", "digest"],
    ["object", "id"],
    ["run", "id"],
    ["revision"],
    ["content", "md5"],
    ["version", "id"],
    ["user", "id"],
    ["correlation", "id"],
    ["token", "hash"],
    ["password", "hash"],
    ["key", "fingerprint"],
    ["secret", "name"],
]
STYLES = ("snake", "screaming", "camel", "pascal", "kebab", "dotted", "flat", "header")


def render(words: list[str], style: str) -> str:
    if style == "snake":
        return "_".join(words)
    if style == "screaming":
        return "_".join(words).upper()
    if style == "camel":
        return words[0] + "".join(w.capitalize() for w in words[1:])
    if style == "pascal":
        return "".join(w.capitalize() for w in words)
    if style == "kebab":
        return "-".join(words)
    if style == "dotted":
        return ".".join(words)
    if style == "flat":
        return "".join(words)
    return "X-" + "-".join(w.capitalize() for w in words)


def key_words(rng: random.Random, nouns: list[list[str]]) -> list[str]:
    """A vendor word (or none) and a noun: [zorbla, api, key]."""
    noun = rng.choice(nouns)
    return ([vendor(rng)] if rng.random() < 0.7 else []) + noun


def neutral_value(rng: random.Random) -> tuple[str, str]:
    """(category, value) of a value that must survive in a context without a cue."""
    category = rng.choice(["sha1", "sha256", "md5", "uuid", "numeric_id", "base64_payload"])
    if category == "uuid":
        return category, str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if category == "numeric_id":
        return category, str(rng.randint(10**15, 10**19))
    if category == "base64_payload":
        return category, base64.b64encode(rng.randbytes(rng.randint(320, 900))).decode()
    n = {"sha1": 40, "sha256": 64, "md5": 32}[category]
    return category, pick(rng, ALPHABETS["hex"], n)
