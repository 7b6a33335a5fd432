"""What is never a secret, wherever it stands: placeholders, references to where a secret
is kept, literals, types, public keys and the values a format marks public.

Every detector checks a value here before it is redacted, and so does every signal a
library (detect-secrets) gives.
"""

from __future__ import annotations

import re

from detect_secrets.filters import heuristic

from capibara_exp.data.e2b.scrub import formats, name_cues, shape

# Values that are never the secret itself.
_LITERALS = frozenset(
    "pass true false none null nil undefined yes no on off required optional empty hidden "
    "redacted masked secret password token string str bytes int".split()
)
_TYPE = re.compile(
    r"(?:str|string|bytes|int|float|bool|number|any|object|dict|list|Optional\[\w+\]"
    r"|Secret\w*|SecretStr|[A-Z][a-z]+(?:[A-Z][a-z]+)+|\w+\[[\w\[\], .|]*\])"
)
_PLACEHOLDER = re.compile(
    r"(?i)^(?:your[\w\-. ]*|(?:my|enter|insert|replace|put|paste)[_\-. ][\w\-. ]*)$|^<[^<>]*>$"
    r"|^\[[\w\- ]+\]$|\.\.\.|…|^x{4,}$|^\*{3,}$|^#{3,}$|^-+$|^%[sd]$|^\{\w*\}$|^\?$|^:\w+$"
    # Words, not letters inside a random key (a base64 key may well hold `FAkE`).
    r"|(?<![a-z])(?:redacted|masked|example|placeholder|dummy|fake|changeme|change_me"
    r"|replace_me|not[\-_ ]a[\-_ ]real|x{4,}|deadbeef|cafebabe)(?![a-z])"
    # AWS's documentation keys: AKIAIOSFODNN7EXAMPLE, wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY.
    r"|(?-i:EXAMPLE)"
)
# Where a secret is kept rather than the secret: environment variables of every language
# E2B runs (Python, JavaScript/TypeScript, R, Java, bash), CI and template variables,
# secret stores.
_REFERENCE = re.compile(
    r"^(?:\$|%\(|%\w+%$|os\.environ|os\.getenv|process\.env|import\.meta\.env|Deno\.env"
    r"|Sys\.getenv|System\.getenv|System\.getProperty|ENV\[|env\(|env::|getenv|secrets\."
    r"|vault:|op://|arn:aws|!Ref\b|@Microsoft\.KeyVault|projects/[\w-]+/secrets/)"
    r"|\$\{|\{\{|\{%"  # a template anywhere: `Basic ${btoa(user)}`, `{{ api_key }}`
    r"|^(?:~|\.{1,2})?(?:/[\w.\-]{1,16})+/?$"
    r"|^[\w.\-]+\.(?:txt|json|ya?ml|pem|key|env|cfg|ini|conf|crt|p12|pfx|jks|der|pub)$"
    r"|^data:\w+/[\w+.\-]+(?:;|$)"  # a data URI (an image, a file) or its MIME type
)
# Public halves: SSH public keys, certificates and public-key blocks.
_PUBLIC = re.compile(
    r"^(?:ssh-(?:rsa|dss|ed25519)|ecdsa-sha2-nistp\d+|sk-ssh-ed25519@openssh\.com)(?:\s|$)"
    r"|-----BEGIN (?:[A-Z0-9]+ )*(?:PUBLIC KEY|CERTIFICATE|CERTIFICATE REQUEST)-----"
)
_SCHEME = re.compile(r"(?i)^(?:bearer|basic|token|digest)\s+")
_NAME = r"[A-Za-z_]\w*"
_CODE_VALUE = re.compile(rf"{_NAME}(?:\.{_NAME})*(?:[(\[].*)?")
# In any text: a call, a subscript or an attribute (`getpass.getpass()`, `cfg.password`).
_EXPRESSION = re.compile(rf"{_NAME}(?:(?:\.{_NAME})+(?:[(\[].*)?|[(\[].*)")
_FILTERS = (
    heuristic.is_sequential_string,
    heuristic.is_templated_secret,
    heuristic.is_prefixed_with_dollar_sign,
)


def not_a_secret(value: str, key: str | None = None) -> bool:
    """A placeholder, literal, type, number, reference, file name or public key."""
    v = _SCHEME.sub("", value.strip().strip("'\"`"))  # `Bearer xxxx`: the credential is xxxx
    if len(v) < 4 or v.lower() in _LITERALS or v.isdigit() or _TYPE.fullmatch(v):
        return True
    if _PLACEHOLDER.search(v) or _REFERENCE.search(v) or _PUBLIC.search(v) or formats.public(v):
        return True
    if any(f(v) for f in _FILTERS):
        return True
    if key is not None and _names_itself(v, key):
        return True  # `password: password`, `token=TOKEN`, `password="some_password"`
    return len(set(v)) <= 2  # `aaaaaaaa`, `12121212`


def _names_itself(value: str, key: str) -> bool:
    """The value is the key's name, or letters around a credential word: what docs write
    where a value goes (`some_password`, `myregistrytoken`)."""
    v, k = value.lower().replace("-", "_"), key.lower().replace("-", "_")
    if v in k:
        return True
    return re.fullmatch(r"[a-z_]+", v) is not None and name_cues.rule(v) is not None


def code_value(value: str, in_code: bool) -> bool:
    """A name, attribute, call or subscript (in code), or an attribute, call or subscript
    (in any text): what an assignment assigns, not a credential. A dotted chain with a
    generated-looking part (`x8tpz53vZ.oXEeJVgm19`) is a token, not an attribute."""
    if in_code and re.search(r"[()\[\]{}+*]", value):
        return True  # an expression: `(self.tokens.peek()`, `taken+len(tokens)`
    if (_CODE_VALUE if in_code else _EXPRESSION).fullmatch(value) is None:
        return False
    return "(" in value or "[" in value or "." not in value or not shape.generated(value)
