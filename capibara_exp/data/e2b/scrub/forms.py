"""Secrets that a syntax, not a name, points at: URL credentials, the password flags of
command-line tools, SQL's password clauses, and passwords passed by position to a login.

Every value found here is checked by keep.py (placeholders, references) before it counts.
"""

from __future__ import annotations

import re

from capibara_exp.data.e2b.scrub import keep, name_cues, shape

# `scheme://user:password@host` (also an empty user: `redis://:pw@cache`) and
# `scheme://TOKEN@host` (a token as the user: git remotes, Sentry DSNs).
_USERINFO = re.compile(
    r"(?i)\b[a-z][a-z0-9+.\-]*://(?P<user>[^\s:/@'\"<>]*)(?::(?P<pw>[^\s@/'\"<>]+))?"
    r"@(?=[\w.\-\[])"
)
# The password flags of tools whose flag names say nothing (`-p`, `-w`, `-a`).
_TOOL_FLAGS = [
    re.compile(p)
    for p in (
        r"\b(?:mysql|mysqldump|mysqladmin|mariadb|mariadb-dump)\b[^\n|;]*?"
        r"\s-p(?P<q>['\"]?)(?P<v>(?!-)[^\s'\"]+|-[^\s'\"\-][^\s'\"]*)(?P=q)",
        r"\b(?:sshpass[\s'\",]+-p|redis-cli\b[^\n|;]*?[\s'\",]-a|(?:docker|podman|helm|oras)"
        r"(?:\s+registry)?\s+login\b[^\n|;]*?\s(?:-p|--password)|ldap\w+\b[^\n|;]*?\s-w"
        r"|sqlcmd\b[^\n|;]*?\s-P|mongosh?\b[^\n|;]*?\s-p|(?:zip|unzip)\b[^\n|;]*?\s-P"
        r"|openssl\b[^\n|;]*?\s-k)[\s'\",]+(?P<q>['\"]?)(?P<v>[^\s'\"$][^\s'\",]*)(?P=q)",
        r"\b7za?\b[^\n|;]*?\s-p(?P<q>['\"]?)(?P<v>[^\s'\"]+)(?P=q)",
        r"-pass(?:in|out)\s+pass:(?P<v>[^\s'\"]+)",
        r"(?<![\w\-])(?:-u|--user)[\s=]+['\"]?[^\s:'\"$]+:(?P<v>[^\s'\"@]+)",
        r"\bsmbclient\b[^\n|;]*?-U\s+['\"]?[^\s%'\"]+%(?P<v>[^\s'\"]+)",
        r"\bhtpasswd\s+-\w*b\w*\s+\S+\s+\S+\s+(?P<q>['\"]?)(?P<v>[^\s'\"]+)(?P=q)",
    )
]
# SQL: `PASSWORD 'x'`, `IDENTIFIED [WITH plugin] BY 'x'`, `SET PASSWORD ... = 'x'`, and
# `NAME 'value'` pairs of DuckDB's CREATE SECRET (`SECRET 'x'`, `KEY_ID 'x'`).
_SQL = [
    re.compile(p)
    for p in (
        r"(?i)\b(?:IDENTIFIED\s+(?:WITH\s+\w+\s+)?BY\s+(?:PASSWORD\s+)?|SET\s+PASSWORD\b[^;\n=]*"
        r"=\s*(?:PASSWORD\s*\(\s*)?)(?P<q>['\"])(?P<v>(?:(?!(?P=q))[^\n])+)(?P=q)",
        r"(?i)\bIDENTIFIED\s+BY\s+(?!VALUES\b|PASSWORD\b)(?P<v>[A-Za-z][\w#$]{3,})",
    )
]
_SQL_PAIR = re.compile(r"(?i)(?<![\w.'\"])(?P<key>[A-Za-z_]\w*)\s+(?P<q>')(?P<v>[^'\n]+)'")
# A password by position: `auth=("u", "pw")`, `HTTPBasicAuth("u", "pw")`, `.login(u, "pw")`,
# `authenticate("u", "pw")`, `Credentials.basic("u", "pw")`.
_AUTH_PAIR = re.compile(
    r"(?:\bauth\s*=\s*[(\[]|\b\w*(?:Basic|Digest|Proxy)Auth\w*\s*\(|\.?\b(?:login|signin|sign_in"
    r"|authenticate|basic|credentials|UsernamePasswordCredentials)\s*\()"
    r"\s*(?:[bru]?['\"][^'\"\n]*['\"]|[\w.]+)\s*,\s*[bru]?['\"](?P<v>[^'\"\n]+)['\"]"
)


def urls(line: str) -> list[tuple[int, int, str]]:
    out = []
    for m in _USERINFO.finditer(line):
        pw, user = m.group("pw"), m.group("user")
        if pw and not keep.not_a_secret(pw):
            out.append((m.start("pw"), m.end("pw"), "url_password"))
        if user and shape.generated(user) and not keep.not_a_secret(user):
            out.append((m.start("user"), m.end("user"), "url_token"))
    return out


_TOOL_WORDS = (
    "mysql",
    "mariadb",
    "sshpass",
    "redis-cli",
    "login",
    "ldap",
    "sqlcmd",
    "mongo",
    "zip",
    "openssl",
    "7z",
    "-pass",
    "-u",
    "--user",
    "smbclient",
    "htpasswd",
)
_PAIR_WORDS = ("auth", "login", "signin", "sign_in", "basic", "credentials")


def tools(line: str) -> list[tuple[int, int, str]]:
    out = []
    lowered = line.lower()
    for regex in _TOOL_FLAGS if any(w in lowered for w in _TOOL_WORDS) else ():
        for m in regex.finditer(line):
            if not keep.not_a_secret(m.group("v")):
                out.append((m.start("v"), m.end("v"), "cli_password"))
    for m in _AUTH_PAIR.finditer(line) if any(w in lowered for w in _PAIR_WORDS) else ():
        if not keep.not_a_secret(m.group("v")):
            out.append((m.start("v"), m.end("v"), "auth_pair"))
    return out


def sql(line: str) -> list[tuple[int, int, str]]:
    out = []
    for regex in _SQL:
        for m in regex.finditer(line):
            if not keep.not_a_secret(m.group("v")):
                out.append((m.start("v"), m.end("v"), "sql_password"))
    for m in _SQL_PAIR.finditer(line):
        rule, value = name_cues.rule(m.group("key")), m.group("v")
        if keep.not_a_secret(value, m.group("key")):
            continue
        if rule == "chosen" or (rule == "generated" and shape.generated(value)):
            out.append((m.start("v"), m.end("v"), "sql_secret"))
    return out
