"""MoE routing data: six expert domains, a difficulty bucket, deterministic splits.

Each example of the execution logs gets one domain: a failed run is `debug` (the task is
reading the error), otherwise SQL is `sql`, numerical/array code is `ml`, code that speaks
a wire format or protocol (JSON, HTTP, URLs, e-mail, encodings) is `api`, and the rest is
`python` or `javascript` (TypeScript goes with JavaScript, R with ml; bash, Java and other
languages with python, the general-code expert). The split is a hash of the example id,
so it never depends on the order or the number of other examples.
"""

from __future__ import annotations

import hashlib
import re

DOMAINS = ("python", "sql", "javascript", "debug", "ml", "api")
DIFFICULTIES = ("easy", "medium", "hard")
SPLITS = ("train", "validation", "test")
_ML = re.compile(
    r"^(numpy|statistics|random|math|cmath|decimal|fractions|pandas|scipy|sklearn|torch|jax"
    r"|tensorflow|polars)(\.|$)"
)
_API = re.compile(
    r"^(json|urllib|http|email|base64|binascii|html|xml|xmlrpc|wsgiref|ipaddress|"
    r"mimetypes|uuid|hashlib|hmac|secrets|ssl|socket|smtplib|imaplib|ftplib|quopri|"
    r"uu|mailbox|netrc|cgi|undici|node-fetch|npm-registry-fetch|libnpm\w*|pacote|requests|httpx"
    r"|aiohttp)(\.|$|/)"
)
_JS_API = re.compile(
    r"\bfetch\(|\bhttps?://|\brequest\(|\bundici\b|\bJSON\.(parse|stringify)\b|\bregistry\b"
)


_IMPORT = re.compile(r"^\s*(?:import|from)\s+([\w.]+)", re.M)


def _first_import(code: str) -> str:
    """The first module a cell imports: the domain of a record with no source (user logs)."""
    m = _IMPORT.search(code)
    return m.group(1) if m else ""


def domain_of(example: dict) -> str:
    """The expert domain of a processed execution example."""
    if not example["succeeded"]:
        return "debug"
    if example["language"] == "sql":
        return "sql"
    module = example["source"].split(":", 1)[-1] or _first_import(example["code"])
    if example["language"] in ("javascript", "typescript"):
        return "api" if _JS_API.search(example["code"]) or _API.match(module) else "javascript"
    if _ML.match(module) or example["language"] == "r":  # R is a statistics language
        return "ml"
    return "api" if _API.match(module) else "python"


def split_of(example_id: str, validation_percent: int, test_percent: int) -> str:
    """train / validation / test from a hash of the id (stable across builds and machines)."""
    bucket = int(hashlib.sha256(example_id.encode()).hexdigest()[:8], 16) % 100
    if bucket < test_percent:
        return "test"
    return "validation" if bucket < test_percent + validation_percent else "train"


def render_execution(example: dict, domain: str) -> str:
    """The training text of an executed cell: routing header, code, then what it showed:
    its output, its stderr, and its error (with the traceback in the debug domain, where
    reading it is the task)."""
    head = (
        f"<domain:{domain}> <difficulty:{example['difficulty']}> <language:{example['language']}>"
    )
    body = [head, "### code", example["code"].rstrip()]
    if example["output"].strip():
        body += ["### output", example["output"].rstrip()]
    if example["stderr"].strip():
        body += ["### stderr", example["stderr"].rstrip()]
    error = example["error"]
    if error:
        if domain == "debug" and error["traceback"].strip():
            body += ["### traceback", error["traceback"].rstrip()]
        body += ["### error", f"{error['name']}: {error['value']}".strip()]
    return "\n".join(body)


def routing_example(example: dict, source: str, validation_percent: int, test_percent: int) -> dict:
    """A routing example of a processed execution example."""
    domain = domain_of(example)
    return {
        "id": example["id"],
        "domain": domain,
        "difficulty": example["difficulty"],
        "source": source,
        "quality": example["quality"],
        "split": split_of(example["id"], validation_percent, test_percent),
        "text": render_execution(example, domain),
    }


def ensure_every_split(examples: list[dict]) -> list[dict]:
    """Move an example into any split that a domain with >= 3 examples left empty.

    A mixture samples every domain task in every split, and an empty split would make it
    spin forever; the moved example is chosen by its hash, so this is deterministic too.
    """
    by_domain: dict[str, list[dict]] = {}
    for ex in examples:
        by_domain.setdefault(ex["domain"], []).append(ex)
    for items in by_domain.values():
        if len(items) < len(SPLITS):
            continue
        for split in SPLITS:
            if any(ex["split"] == split for ex in items):
                continue
            donors = sorted(
                (ex for ex in items if sum(e["split"] == ex["split"] for e in items) > 1),
                key=lambda ex: hashlib.sha256(ex["id"].encode()).hexdigest(),
            )
            donors[0]["split"] = split
    return examples
