"""Must-survive text of the held-out corpus: harvested from the files on this machine.

What a scrubber must leave alone, taken from real files rather than written here: the
sha256 lines of installed packages' RECORD files, hex digests of stdlib files, UUIDs
and the source lines they stand in, images shipped inside installed packages (as the
base64 data URIs notebooks print), stdlib source lines whose names speak of passwords,
tokens, secrets and keys without holding one, and the URLs and e-mail addresses of
package metadata. Three small groups follow written conventions instead, as nothing on
a machine holds them reliably: placeholders (`YOUR_API_KEY`, `sk-...`, `${DB_PASSWORD}`),
AWS Secrets Manager ARNs (`...:secret:name-AbCdEf`, AWS's ARN format) and the example
credentials AWS documents (`AKIAIOSFODNN7EXAMPLE`) with the fake values test suites use.
"""

from __future__ import annotations

import ast
import base64
import functools
import hashlib
import importlib.metadata
import random
import re
import sysconfig
import uuid
from pathlib import Path

from capibara_exp.data.corpus import stdlib_sources
from capibara_exp.data.e2b.heldout import log_contexts
from capibara_exp.data.e2b.heldout.credential_formats import FORMATS

_UUID = re.compile(
    rb"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
_NAME = re.compile(r"(?i)passw|passphrase|token|secret|api_?key|auth|credential|private_?key")
_IMAGES = (".png", ".gif", ".jpg", ".jpeg", ".ico")


def _distributions() -> list:
    dists = {d.metadata["Name"] or "": d for d in importlib.metadata.distributions()}
    return [dists[k] for k in sorted(dists)]


def record_lines(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """`path,sha256=<urlsafe base64>,size` lines of installed packages' RECORD files."""
    found = []
    for dist in _distributions():
        text = dist.read_text("RECORD") or ""
        found += [line for line in text.splitlines() if ",sha256=" in line]
    return [("stdout", line) for line in rng.sample(found, min(n, len(found)))]


def hex_digests(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """md5/sha1/sha256 digests of stdlib files as sha256sum, Python and code print them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = rng.sample(list(stdlib_sources()), min(n, len(stdlib_sources())))
    out = []
    for i, path in enumerate(files):
        algo = ("md5", "sha1", "sha256", "blake2b")[i % 4]
        digest = hashlib.new(algo, path.read_bytes()).hexdigest()
        rel = path.relative_to(root)
        out.append(
            [
                ("stdout", f"{digest}  {rel}"),
                ("stdout", f"'{digest}'"),
                ("python", f'EXPECTED_{algo.upper()} = "{digest}"'),
                ("stdout", f"{algo}:{digest}"),
            ][i % 4]
        )
    return out


def _source_files() -> list[Path]:
    """The stdlib's modules and tests (where installed), then installed packages' sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    tests = sorted((stdlib / "test").glob("test_*.py"))
    return [*stdlib_sources(), *tests, *sorted(purelib.glob("*/*.py"))]


def uuid_lines(rng: random.Random, n: int) -> tuple[list[tuple[str, str]], int]:
    """Source lines that hold a UUID, from installed files; topped up with seeded uuid4s
    (RFC 4122) where the machine has fewer. Returns (samples, how many were harvested)."""
    found: dict[str, str] = {}
    for path in _source_files():
        if len(found) >= n:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for m in _UUID.finditer(data):
            start, end = data.rfind(b"\n", 0, m.start()) + 1, data.find(b"\n", m.end())
            line = data[start : end if end != -1 else len(data)].decode("utf-8", "replace").strip()
            if len(line) < 300 and line not in found:
                found[line] = line
    out = [("python", line) for line in list(found)[:n]]
    harvested = len(out)
    while len(out) < n:
        u = uuid.UUID(int=rng.getrandbits(128), version=4)
        out.append(rng.choice([("python", f'run_id = "{u}"'), ("stdout", f"request-id: {u}")]))
    return out, harvested


def image_uris(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Images shipped in installed packages, as notebooks print them (base64 data URIs)."""
    found = []
    for dist in _distributions():
        for f in dist.files or []:
            if str(f).lower().endswith(_IMAGES):
                found.append(Path(str(dist.locate_file(f))))
    found = [p for p in found if p.is_file() and p.stat().st_size <= 48_000]
    out = []
    for i, path in enumerate(rng.sample(found, min(n, len(found)))):
        mime = "image/" + {"jpg": "jpeg", "ico": "x-icon"}.get(path.suffix[1:], path.suffix[1:])
        data = base64.b64encode(path.read_bytes()).decode()
        out.append(
            ("stdout", f'<img src="data:{mime};base64,{data}" alt="{path.name}">')
            if i % 2
            else ("stdout", f"![{path.stem}](data:{mime};base64,{data})")
        )
    return out


_CHOSEN_NAME = re.compile(r"(?i)passw|secret|credential|pwd")
_WORD = re.compile(r"[a-z][a-z_\- ]{0,30}")


def _targets(node) -> tuple[list[str], object]:
    """(names, value) of an assignment, keyword argument, comparison or function def."""
    if isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [ast.unparse(t) for t in targets], node.value
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg], node.value
    if isinstance(node, ast.Compare) and len(node.comparators) == 1:
        return [ast.unparse(node.left)], node.comparators[0]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return [a.arg for a in node.args.args], None
    return [], None


def _kind(names: list[str], value) -> str | None:
    """ "name": the value is a name, attribute, call or subscript; "word": a plain word
    literal under a token/key/auth name (a lexer's `token_type = 'comment'`); None: a
    literal that could be a real (test) credential, not a negative."""
    if not isinstance(value, ast.Constant) or not isinstance(value.value, str | bytes):
        return "name"
    if isinstance(value.value, str) and _WORD.fullmatch(value.value):
        return None if any(_CHOSEN_NAME.search(n) for n in names) else "word"
    return None


def _parse_line(text: str):
    """The syntax tree of one source line read alone (an `if`/`def` header completed)."""
    for candidate in (text, text + " pass", re.sub(r"^(?:el)?if |^while |:$", "", text)):
        try:
            return ast.parse(candidate)
        except (SyntaxError, ValueError):
            continue
    return None


def _named_lines(path: Path) -> list[tuple[str, str]]:
    """(kind, line) of the lines of a module that name a password, token, secret or key
    without holding one (see `_kind`), each line parsed alone."""
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for line in source.splitlines():
        text = line.strip()
        if not (8 <= len(text) <= 160 and _NAME.search(text)) or text.startswith("#"):
            continue
        tree = _parse_line(text)
        for node in ast.walk(tree) if tree else ():
            names, value = _targets(node)
            if any(_NAME.search(n) for n in names) and (kind := _kind(names, value)):
                out.append((kind, text))
                break
    return out


# How many lines of each kind to harvest (then sampled): names are everywhere, so a few
# per module from many modules; plain-word literals are rarer (lexers, parsers).
_HARVEST = {"name": (200, 3), "word": (60, 1000)}


@functools.cache
def _harvest_named() -> dict[str, list[str]]:
    """Lines of each kind from stdlib modules in a fixed shuffled order."""
    found: dict[str, set[str]] = {kind: set() for kind in _HARVEST}
    files = list(stdlib_sources())
    random.Random(0).shuffle(files)
    for path in files:
        lines = set(_named_lines(path))
        for kind, (_, per_module) in _HARVEST.items():
            found[kind] |= set(sorted(line for k, line in lines if k == kind)[:per_module])
        if all(len(found[k]) >= want for k, (want, _) in _HARVEST.items()):
            break
    return {k: sorted(v) for k, v in found.items()}


def identifier_lines(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Lines that name a credential but hold a name, attribute, call or subscript."""
    found = _harvest_named()["name"]
    return [("python", line) for line in rng.sample(found, min(n, len(found)))]


def word_literal_lines(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Lines that give a token/key/auth name a plain word (`token_type = 'comment'`,
    `if token == "lambda"`); password and secret names are left out (a word there may
    be a real password)."""
    found = _harvest_named()["word"]
    return [("python", line) for line in rng.sample(found, min(n, len(found)))]


def metadata_lines(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """URLs and e-mail addresses from installed packages' metadata (user@host, no password)."""
    found = set()
    for dist in _distributions():
        meta = dist.metadata
        for key in ("Home-page", "Download-URL", "Project-URL", "Author-email", "Maintainer-email"):
            for value in meta.get_all(key) or []:
                found.add(f"{key}: {value}")
    found = sorted(found)
    return [("stdout", line) for line in rng.sample(found, min(n, len(found)))]


# Placeholders as docs and templates write them (the must-survive list and kin).
PLACEHOLDERS = (
    "YOUR_API_KEY",
    "<your-api-key>",
    "your-api-key-here",
    "sk-...",
    "e2b_...",
    "hf_...",
    "${DB_PASSWORD}",
    "$DB_PASSWORD",
    "${{ secrets.API_TOKEN }}",
    "{{ api_key }}",
    "<TOKEN>",
    "********",
    "xxxxxxxxxxxxxxxxxxxx",
    "<REDACTED>",
    "REPLACE_ME",
    "${API_KEY:-}",
)
# Test fixtures: the credentials AWS's documentation uses in every example (not live
# keys), and values test suites give fake credentials.
FIXTURES = (
    "AKIAIOSFODNN7EXAMPLE",
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "dummy-token",
    "fake-api-key",
    "example-password",
    "not-a-real-secret",
    "FAKE_SECRET_FOR_TESTS",
    "dummy_password_123",
    "placeholder-token",
    "sk_test_dummy",
)


def _in_contexts(values: tuple[str, ...], rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Each value where a credential would stand (the positives' assignment, env, setting
    and URL contexts), under the names real formats use."""
    groups = ("assign", "env", "config", "url_query")
    templates = [c for g in groups for c in log_contexts.GROUPS[g]]
    out = []
    for i in range(n):
        fmt, value = FORMATS[i % len(FORMATS)], values[i % len(values)]
        channel, template = rng.choice(templates)
        text = template.format(
            s=value,
            u=value,
            esc=value,
            env=fmt.env,
            kwarg=fmt.kwarg,
            camel=fmt.kwarg,
            pair_id=FIXTURES[0],
        )
        out.append((channel, text))
    return out


def placeholder_lines(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return _in_contexts(PLACEHOLDERS, rng, n)


def fixture_lines(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return _in_contexts(FIXTURES, rng, n)


def arn_lines(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """AWS Secrets Manager ARNs: arn:aws:secretsmanager:<region>:<account>:secret:<name>-<6>."""
    out = []
    for i in range(n):
        region = rng.choice(["us-east-1", "eu-west-1", "ap-southeast-2"])
        name = rng.choice(["prod/db", "ci/github-token", "billing/stripe", "app-secret"])
        suffix = "".join(
            rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz") for _ in range(6)
        )
        account = rng.randint(10**11, 10**12 - 1)
        arn = f"arn:aws:secretsmanager:{region}:{account}:secret:{name}-{suffix}"
        out.append(
            [
                ("python", f'client.get_secret_value(SecretId="{arn}")'),
                ("stdout", f"{{'ARN': '{arn}', 'Name': '{name}'}}"),
                ("stdout", f"secret_arn: {arn}"),
                ("python", f"!aws secretsmanager get-secret-value --secret-id {arn}"),
            ][i % 4]
        )
    return out
