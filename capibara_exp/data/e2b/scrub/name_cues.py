"""Names as credential cues: what a key, column, flag, header or callee name says of the
value beside it, in any case style (snake, camel, kebab, upper, dotted) and in the words
of several languages.

`rule(name)`: "chosen" (a password or secret a person picks: any value counts),
"generated" (a key or token: the value must look generated), "none" (the name is about
a credential, not holding one: `token_type`, `password_file`, `publishable_key`), or None
(not a credential name at all). No provider is named here: the words are generic.
"""

from __future__ import annotations

import functools
import re

# Words for a secret a person chooses, in English and other languages people name
# settings in (German, Spanish, Portuguese, French, Italian, Dutch, Polish, Swedish,
# Finnish, Hungarian, Turkish, Czech, Russian, Chinese, Japanese, Korean).
_CHOSEN = frozenset(
    "password passwd pwd pass passphrase passcode secret secrets passwort kennwort "
    "contrasena contraseña clave senha motdepasse passe mdp parola wachtwoord haslo hasło "
    "losenord salasana jelszo jelszó sifre şifre heslo geslo lozinka parol пароль "
    "密码 密碼 口令 パスワード 비밀번호 암호 geheim segreto secreto".split()
)
# Words for a credential a machine generates. `key` alone is here too: a sort key or a
# dict key holds a word, which the shape test then keeps.
_GENERATED = frozenset(
    "token tokens apikey key keys credential credentials cred creds auth authorization "
    "authentication authtoken bearer sig signature sas pat dsn webhook cookie session "
    "login signin jeton chave clé cle chiave llave schlüssel schluessel sleutel klucz "
    "nyckel avain ключ токен 令牌 密钥 キー トークン 토큰 otp totp hmac license licence".split()
)
# Credential words a flat compound may end with (`key` needs a qualifier, see _flat).
_LONG_CUES = tuple(
    sorted(
        (w for w in _CHOSEN | _GENERATED if len(w) >= 5 or not w.isascii()), key=len, reverse=True
    )
) + ("pwd",)
# Last words that make a name about a credential rather than its holder.
_ABOUT = frozenset(
    "type types kind name names len length count size file files path paths dir field "
    "fields header headers prefix suffix class style id ids url urls uri endpoint var env "
    "ttl expiry expires expiration expired index idx pos start end list map regex pattern "
    "format fmt hash hashed digest checksum sha md5 policy mode label help prompt text "
    "message msg limit min max required enabled disabled timeout version store manager "
    "provider backend cache source encoding method scheme number num offset counter "
    "location arn ref param params parameter option options flag input widget error "
    "errors status valid validator strength hint placeholder description desc title "
    "column table rotation algorithm alg bits usage audience issuer lifetime age days "
    "mask masked redacted exists set updated created changed reset rule rules fingerprint "
    "thumbprint kid "
    "schema spec generator loader reader writer parser handler factory "
    "service client manager_ helper util utils test tests".split()
)
# A credential the format itself marks public.
_PUBLIC = frozenset({"public", "publishable", "pub", "pubkey", "publickey"})
# `key` after these words names a lookup, not a credential (`sort_key`, `cacheKey`,
# `idempotency_key`, `partitionKey`, an S3 object key); and English words ending in `key`.
_NOT_KEY = frozenset(
    "sort cache primary foreign partition row dict hash lookup group idempotency dedup "
    "dedupe unique composite object s3 bucket map index shard routing message column "
    "attribute tuple range order join cluster distribution natural surrogate candidate".split()
)
_KEY_WORDS = (
    "monkey",
    "donkey",
    "turkey",
    "hockey",
    "jockey",
    "whiskey",
    "hotkey",
    "passkey",
    "latchkey",
    "lackey",
    "malarkey",
    "flunkey",
    "hokey",
    "pokey",
    "jokey",
    "smokey",
)
# A key that identifies a key pair's secret half (`aws_access_key_id`, `KEY_ID`): generated.
_KEY_ID = re.compile(r"(?:^|_)(?:access_?key|key)_?id$")
_PIECES = re.compile(r"[^\W_]+")
# Tails a flat compound may end with after its credential word (`chaveapi`, `masterkey`).
_TAILS = ("api", "key", "value", "str", "s")


def _camel(piece: str) -> list[str]:
    """camelCase and PascalCase pieces split where the case changes (any script)."""
    out, start = [], 0
    for i in range(1, len(piece)):
        a, b = piece[i - 1], piece[i]
        nxt = piece[i + 1] if i + 1 < len(piece) else ""
        if (
            (a.islower() and b.isupper())
            or (a.isupper() and b.isupper() and nxt.islower())
            or (a.isdigit() != b.isdigit())
        ):
            out.append(piece[start:i])
            start = i
    out.append(piece[start:])
    return out


def words(name: str) -> list[str]:
    """A name's words, lower-cased: `stripeSecretKey` -> [stripe, secret, key]."""
    return [w.lower() for piece in _PIECES.findall(name) for w in _camel(piece) if w]


def _is_cue(word: str) -> str | None:
    if word in _CHOSEN:
        return "chosen"
    if word in _GENERATED:
        return "generated"
    return _flat(word)


@functools.lru_cache(maxsize=1 << 14)
def _flat(word: str) -> str | None:
    """A flat compound's rule: a credential word at its end, maybe before a tail
    (`dbpassword`, `clientsecret`, `vonochaveapi`, `petimasterkey`)."""
    for tail in ("", *_TAILS):
        if tail and not word.endswith(tail):
            continue
        stem = word[: len(word) - len(tail)]
        for cue in _LONG_CUES:
            if stem.endswith(cue) and len(stem) > len(cue) - (1 if tail else 0):
                return "chosen" if cue in _CHOSEN else "generated"
        if (
            tail == "key"
            and len(stem) >= 2
            and not (word.endswith(_KEY_WORDS) or stem.endswith(tuple(_NOT_KEY)))
        ):
            return "generated"  # a vendor's name and `key` (`stripekey`), not `monkey`
    return None


@functools.lru_cache(maxsize=1 << 14)
def rule(name: str) -> str | None:
    """ "chosen", "generated", "none" (about a credential) or None (no credential word)."""
    ws = words(name)
    cues = [(i, r) for i, w in enumerate(ws) if (r := _is_cue(w))]
    if not cues:
        return None
    if _PUBLIC.intersection(ws):
        return "none"
    while len(ws) > 1 and ws[-1].isdigit():
        ws = ws[:-1]  # `password_sha256`: the last word is `sha`
    last, (at, _) = ws[-1], cues[-1]
    if last in ("key", "keys") and len(ws) > 1 and ws[-2] in _NOT_KEY:
        return None
    if last in _ABOUT and at < len(ws) - 1:
        if last in ("id", "ids") and _KEY_ID.search("_".join(ws)):
            return "generated"
        if last in ("url", "uri", "urls") and "webhook" in ws:
            return "generated"  # a webhook URL carries its secret in the path
        return "none"
    return "chosen" if any(r == "chosen" for _, r in cues) else "generated"
