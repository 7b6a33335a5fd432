"""Secrets that span lines or hide in an encoding: key blocks of any armour (PEM, OpenSSH,
PGP, SSH2, PuTTY), base64 that decodes to a secret (kubeconfig `client-key-data`, `*_b64`
settings, a PEM block encoded whole), and the values of a Kubernetes Secret.
"""

from __future__ import annotations

import base64
import binascii
import re

from capibara_exp.data.e2b.scrub import keep, name_cues, prefilter, shape

# `-----BEGIN <label with PRIVATE or SECRET>-----` (PEM, OpenSSH, PGP) and SSH2's
# `---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----`: the label says what the block holds.
_BEGIN = re.compile(
    r"-{4,5} ?BEGIN (?P<label>(?:[A-Z0-9]+ )*?(?:PRIVATE|SECRET)(?: [A-Z0-9]+)*) ?-{4,5}"
)
_PUTTY = re.compile(r"PuTTY-User-Key-File-\d+:")
_PUTTY_PRIVATE = re.compile(r"Private-Lines: *(\d+)[ \t]*\n")
_PUTTY_MAC = re.compile(r"Private-(?:MAC|Hash): *[0-9a-fA-F]+")
# base64 of "-----BEGIN" at any alignment, and of "-----" alone.
_ENCODED_PEM = re.compile(r"(?:LS0tLS1CRUdJTi|0tLS0tQkVHSU4g|tLS0tLUJFR0lOI)[A-Za-z0-9+/]*={0,2}")
_BASE64 = r"[A-Za-z0-9+/\-_]{16,}={0,2}"
# Settings whose values are encoded: `client-key-data`, `token_b64`, `secretBase64`.
_ENCODED_NAME = re.compile(
    rf"(?i)(?<![\w\-])(?P<key>[\w.\-]*(?:data|b64|base64|encoded|blob))['\"]?\s*[:=]\s*['\"]?"
    rf"(?P<v>{_BASE64})"
)
_K8S_SECRET = re.compile(r"(?m)^\s*kind\s*:\s*['\"]?Secret['\"]?\s*$|\"kind\"\s*:\s*\"Secret\"")
_YAML_MAP = re.compile(r"(?m)^(?P<indent>[ \t]*)(?:data|stringData)\s*:\s*$")
_YAML_ITEM = re.compile(r"[ \t]+[\w.\-]+\s*:\s*['\"]?(?P<v>[^'\"\n#]+?)['\"]?\s*$")
_JSON_MAP = re.compile(r"\"(?:data|stringData)\"\s*:\s*\{(?P<body>[^{}]*)\}")
_JSON_ITEM = re.compile(r"\"[\w.\-]+\"\s*:\s*\"(?P<v>[^\"]+)\"")


# `- name: API_TOKEN` then `value: ...` (Kubernetes env, CloudFormation parameters, compose),
# `{"name": "API_TOKEN", "value": "..."}`, `{"Key": "password", "Value": "..."}`.
_NAME_VALUE = re.compile(
    r"(?i)[\"']?(?:name|key|parameterkey|variable|setting)[\"']?\s*[:=]\s*[\"']?(?P<key>[\w.\-]+)[\"']?"
    r"[ \t]*(?:,[ \t]*|\n[ \t]*-?[ \t]*)[\"']?(?:value|parametervalue|val)[\"']?\s*[:=]\s*"
    r"(?:\"(?P<dq>[^\"\n]*)\"|'(?P<sq>[^'\n]*)'|(?P<bare>[^\s,}\"']+))"
)


def name_value_pairs(text: str, lowered: str) -> list[tuple[int, int, str]]:
    """A value whose sibling `name` field names a credential."""
    out = []
    matches = (
        m
        for lo, hi in prefilter.windows(lowered, ("value", "parametervalue"), 200, 300)
        for m in _NAME_VALUE.finditer(text, lo, hi)
    )
    for m in matches:
        group = next(g for g in ("dq", "sq", "bare") if m.group(g) is not None)
        key, value = m.group("key"), m.group(group)
        rule = name_cues.rule(key)
        if rule not in ("chosen", "generated") or keep.not_a_secret(value, key):
            continue
        if rule == "chosen" or shape.generated(value):
            out.append((m.start(group), m.end(group), "name_value_secret"))
    return out


def key_blocks(text: str) -> list[tuple[int, int, str]]:
    out = []
    for m in _BEGIN.finditer(text):
        end = re.compile(r"-{4,5} ?END " + re.escape(m.group("label")) + r" ?-{4,5}")
        found = end.search(text, m.end())
        out.append((m.start(), found.end() if found else len(text), "private_key"))
    for m in _PUTTY.finditer(text):
        private = _PUTTY_PRIVATE.search(text, m.end())
        if private is None:
            continue
        stop = private.end()
        for _ in range(int(private.group(1))):
            nl = text.find("\n", stop)
            stop = len(text) if nl == -1 else nl + 1
        mac = _PUTTY_MAC.match(text, stop)
        out.append((private.end(), mac.end() if mac else stop, "private_key"))
    return out


def decoded(value: str) -> str | None:
    """The text a base64 value encodes (standard or URL-safe), or None if not text."""
    padded = value + "=" * (-len(value) % 4)
    try:
        raw = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
        text = raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    printable = sum(ch.isprintable() or ch in "\n\r\t" for ch in text)
    return text if text and printable >= 0.95 * len(text) else None


def encoded(text: str, lowered: str, holds_secret) -> list[tuple[int, int, str]]:
    """base64 values that decode to a key block or to text `holds_secret` finds a secret in."""
    out = []
    for m in _ENCODED_PEM.finditer(text):
        plain = decoded(m.group())
        if plain and _BEGIN.search(plain):
            out.append((m.start(), m.end(), "encoded_private_key"))
    names_at = prefilter.windows(lowered, ("data", "b64", "base64", "encoded", "blob"), 100, 4096)
    for m in (m for lo, hi in names_at for m in _ENCODED_NAME.finditer(text, lo, hi)):
        plain = decoded(m.group("v"))
        if plain and (_BEGIN.search(plain) or holds_secret(plain)):
            out.append((m.start("v"), m.end("v"), "encoded_secret"))
    return out


def kubernetes_secrets(text: str) -> list[tuple[int, int, str]]:
    """Every value under `data:` / `stringData:` of a manifest of `kind: Secret`."""
    if _K8S_SECRET.search(text) is None:
        return []
    out = []
    for m in _YAML_MAP.finditer(text):
        indent, pos = len(m.group("indent").expandtabs()), m.end() + 1
        for line in text[pos:].split("\n"):
            item = _YAML_ITEM.fullmatch(line)
            if not line.strip() or item is None or len(line) - len(line.lstrip()) <= indent:
                break
            if not keep.not_a_secret(item.group("v")):
                out.append((pos + item.start("v"), pos + item.end("v"), "kubernetes_secret"))
            pos += len(line) + 1
    for m in _JSON_MAP.finditer(text):
        for item in _JSON_ITEM.finditer(m.group("body")):
            if not keep.not_a_secret(item.group("v")):
                base = m.start("body")
                out.append((base + item.start("v"), base + item.end("v"), "kubernetes_secret"))
    return out
