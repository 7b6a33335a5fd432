"""Which lines of a text the detectors need to read: most lines of an execution log hold
no credential cue and no long token, and are skipped.

Cue words are found with the string search of an ASCII-lower-cased copy (same length, same
offsets), one word at a time over the whole text, which is far cheaper than a regex
alternation per line; words in other scripts are looked for only in non-ASCII text.
"""

from __future__ import annotations

import bisect
import re

# Stems of credential names, auth errors and the tools whose flags carry passwords.
ASCII_CUES = (
    "pass",
    "pwd",
    "secret",
    "token",
    "key",
    "auth",
    "cred",
    "bearer",
    "sig",
    "sas",
    "pat",
    "dsn",
    "webhook",
    "cookie",
    "session",
    "login",
    "signin",
    "otp",
    "hmac",
    "licen",
    "jeton",
    "chave",
    "chiave",
    "llave",
    "schl",
    "sleutel",
    "klucz",
    "nyckel",
    "avain",
    "kennwort",
    "contrase",
    "senha",
    "mdp",
    "parola",
    "wachtwoord",
    "haslo",
    "losenord",
    "salasana",
    "jelsz",
    "sifre",
    "heslo",
    "geslo",
    "lozinka",
    "parol",
    "geheim",
    "segreto",
    "secreto",
    "clave",
    "cle",
    "401",
    "403",
    "unauthori",
    "forbidden",
    "denied",
    "invalid",
    "incorrect",
    "expired",
    "revoked",
    "malformed",
    "mysql",
    "mariadb",
    "sqlcmd",
    "mongo",
    "7z",
    "zip",
    "openssl",
    "smbclient",
    "htpasswd",
    "curl",
    "wget",
    " -u ",
    "identified",
    "://",
    "begin",
    "putty",
    "private",
    "alue",
    "kind:",
    "ldap",
    "sshpass",
    "redis",
    "docker",
    "podman",
    "helm",
    "oras",
)
_OTHER_CUES = re.compile(
    r"(?i)clé|schlüssel|hasło|şifre|contraseña|пароль|ключ|токен|密码|密碼|口令|パスワード"
    r"|비밀번호|암호|令牌|密钥|キー|トークン|토큰"
)
_LONG_RUN = re.compile(r"[\w\-+/.~%]{16,}")
_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def lower(text: str) -> str:
    """ASCII letters lower-cased: same length and offsets as the text."""
    return text.translate(_LOWER)


def _line_of(starts: list[int], pos: int) -> int:
    return bisect.bisect_right(starts, pos) - 1


def line_starts(text: str) -> list[int]:
    starts, at = [0], text.find("\n")
    while at != -1:
        starts.append(at + 1)
        at = text.find("\n", at + 1)
    return starts


def lines_with(text: str, lowered: str, starts: list[int], words=ASCII_CUES) -> set[int]:
    """Indices of the lines that hold one of `words` (or, in non-ASCII text, a cue word of
    another script)."""
    found: set[int] = set()
    for word in words:
        at = lowered.find(word)
        while at != -1:
            line = _line_of(starts, at)
            found.add(line)
            nxt = starts[line + 1] if line + 1 < len(starts) else len(text)
            at = lowered.find(word, nxt)  # one hit per line is enough
    if not text.isascii():
        found |= {_line_of(starts, m.start()) for m in _OTHER_CUES.finditer(text)}
    return found


def long_run_lines(text: str, starts: list[int]) -> set[int]:
    """Indices of the lines that hold a run of 16+ token characters."""
    return {_line_of(starts, m.start()) for m in _LONG_RUN.finditer(text)}


def windows(lowered: str, words: tuple[str, ...], before: int, after: int):
    """(start, end) windows around each occurrence of `words` in the lowered text, merged."""
    spans = []
    for word in words:
        at = lowered.find(word)
        while at != -1:
            spans.append((max(0, at - before), min(len(lowered), at + len(word) + after)))
            at = lowered.find(word, at + 1)
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged
