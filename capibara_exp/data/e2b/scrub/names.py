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
# Compounds written as one word end in one of these (`clientsecret`, `authtoken`,
# `myapikey`, `dbpassword`); `key` alone would catch `monkey`, `hotkey`, `turkey`.
_SUFFIXES = ("password", "passwd", "passphrase", "secret", "token", "apikey", "accesskey",
             "secretkey", "privatekey", "authkey", "signingkey", "credential", "credentials",
             "passwort", "kennwort")
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
    "mask masked redacted exists set updated created changed reset length_ rule rules "
    "policy_ schema spec generator loader reader writer parser provider_ handler factory "
    "service client manager_ helper util utils test tests".split()
)
# A credential the format itself marks public.
_PUBLIC = frozenset({"public", "publishable", "pub", "pubkey", "publickey"})
# A key that identifies a key pair's secret half (`aws_access_key_id`, `KEY_ID`): generated.
_KEY_ID = re.compile(r"(?:^|_)(?:access_?key|key)_?id$")
_SPLIT = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[^\W\d_A-Z]+|[A-Z]+|\d+")


def words(name: str) -> list[str]:
    """A name's words, lower-cased: `stripeSecretKey` -> [stripe, secret, key]."""
    return [w.lower() for w in _SPLIT.findall(name.strip("-$@'\"[]`"))]


def _is_cue(word: str) -> str | None:
    if word in _CHOSEN:
        return "chosen"
    if word in _GENERATED:
        return "generated"
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) > len(suffix):
            return "chosen" if suffix.startswith(("pass", "secret", "kenn")) else "generated"
    return None


@functools.lru_cache(maxsize=1 << 14)
def rule(name: str) -> str | None:
    """"chosen", "generated", "none" (about a credential) or None (no credential word)."""
    ws = words(name)
    cues = [(i, r) for i, w in enumerate(ws) if (r := _is_cue(w))]
    if not cues:
        return None
    if _PUBLIC.intersection(ws):
        return "none"
    while len(ws) > 1 and ws[-1].isdigit():
        ws = ws[:-1]  # `password_sha256`: the last word is `sha`
    last, (at, _) = ws[-1], cues[-1]
    if last in _ABOUT and at < len(ws) - 1:
        if last in ("id", "ids") and _KEY_ID.search("_".join(ws)):
            return "generated"
        if last in ("url", "uri", "urls") and "webhook" in ws:
            return "generated"  # a webhook URL carries its secret in the path
        return "none"
    return "chosen" if any(r == "chosen" for _, r in cues) else "generated"
