"""Generated contexts that are layouts rather than lines: tables as pandas, psql, mysql,
DuckDB, sqlite3, Markdown and CSV print them (and SQL dumps as Python's own sqlite3 writes
them), and key material in every armour (PEM labels, SSH2, PuTTY, JSON-escaped, base64
inside kubeconfig and Kubernetes Secrets, encoded settings).

Each function takes the credential column's name (or a neutral one) and the value, and
returns (channel, text).
"""

from __future__ import annotations

import base64
import random
import sqlite3

from capibara_exp.data.e2b.heldout.tokens import pick, vendor

_OTHER = [
    ("service", ["billing", "search", "mailer"]),
    ("created", ["2024-03-01", "2024-05-17", "2025-01-09"]),
]


def _rows(rng: random.Random, name: str, value: str) -> tuple[list[str], list[list[str]], int]:
    """Columns, rows (the value in one row) and the value's row."""
    cols = ["service", name, "created"]
    rows = [
        [_OTHER[0][1][i], pick(rng, "abcdefghjkmnpqrstuvwxyz23456789", 12), _OTHER[1][1][i]]
        for i in range(3)
    ]
    at = rng.randrange(3)
    rows[at][1] = value
    return cols, rows, at


def _pandas(cols, rows) -> str:
    """As pandas prints a DataFrame: right-aligned columns, the index at the left."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    index_w = len(str(len(rows) - 1))
    lines = [" " * index_w + "".join("  " + c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    for i, r in enumerate(rows):
        lines.append(
            str(i).ljust(index_w)
            + "".join("  " + v.rjust(w) for v, w in zip(r, widths, strict=True))
        )
    return "\n".join(lines)


def _html(cols, rows) -> str:
    """As pandas' to_html (what E2B's Result.html holds for a DataFrame)."""
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join(
        f"<tr><th>{i}</th>" + "".join(f"<td>{v}</td>" for v in r) + "</tr>\n"
        for i, r in enumerate(rows)
    )
    return (
        '<table border="1" class="dataframe">\n<thead><tr style="text-align: right;"><th></th>'
        f"{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"
    )


def _grid(cols, rows, style: str) -> str:
    """As psql, mysql, DuckDB (boxes), Markdown and CSV print a result."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def cells(row, sep: str, pad: str = " ") -> str:
        return sep.join(f"{pad}{c.ljust(w)}{pad}" for c, w in zip(row, widths, strict=True))

    if style == "psql":
        rule = "+".join("-" * (w + 2) for w in widths)
        return "\n".join([cells(cols, "|"), rule, *(cells(r, "|") for r in rows), "(3 rows)"])
    if style == "markdown":
        rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        body = ["|" + cells(r, "|") + "|" for r in [cols, *rows]]
        return "\n".join([body[0], rule, *body[1:]])
    if style == "csv":
        return "\n".join(",".join(r) for r in [cols, *rows])
    bar, side = ("─", "│") if style == "duckdb" else ("-", "|")
    corners = ("┌┬┐", "├┼┤", "└┴┘") if style == "duckdb" else ("+++",) * 3

    def rule(c: str) -> str:
        return c[0] + c[1].join(bar * (w + 2) for w in widths) + c[2]

    lines = [side + cells(r, side) + side for r in [cols, *rows]]
    return "\n".join([rule(corners[0]), lines[0], rule(corners[1]), *lines[1:], rule(corners[2])])


def _sqlite_dump(name: str, value: str, pair: bool) -> str:
    """INSERTs as Python's sqlite3 dumps them (iterdump), a credential column or name/value rows."""
    db = sqlite3.connect(":memory:")
    if pair:
        db.execute("CREATE TABLE settings (name TEXT, value TEXT)")
        db.executemany(
            "INSERT INTO settings VALUES (?, ?)", [("region", "eu-west-1"), (name, value)]
        )
    else:
        db.execute(f'CREATE TABLE credentials (service TEXT, "{name}" TEXT)')
        db.execute("INSERT INTO credentials VALUES (?, ?)", ("billing", value))
    text = "\n".join(line for line in db.iterdump() if line.startswith(("CREATE", "INSERT")))
    db.close()
    return text


TABLE_STYLES = (
    "pandas",
    "html",
    "psql",
    "mysql",
    "duckdb",
    "markdown",
    "csv",
    "pairs",
    "insert",
    "insert_pairs",
)


def table(rng: random.Random, name: str, value: str) -> tuple[str, str]:
    style = rng.choice(TABLE_STYLES)
    cols, rows, _ = _rows(rng, name, value)
    if style == "pandas":
        return "result", _pandas(cols, rows)
    if style == "html":
        return "result_html", _html(cols, rows)
    if style == "pairs":  # a name/value frame: the name in one column, the value beside it
        return "result", _pandas(["name", "value"], [["region", "eu-west-1"], [name, value]])
    if style in ("insert", "insert_pairs"):
        return "sql", _sqlite_dump(name, value, style == "insert_pairs")
    return "stdout", _grid(cols, rows, style)


def _pem_body(rng: random.Random, n_bytes: int, width: int = 64) -> list[str]:
    text = base64.b64encode(rng.randbytes(n_bytes)).decode()
    return [text[i : i + width] for i in range(0, len(text), width)]


def key_block(rng: random.Random) -> str:
    """Private key material in an armour: PEM with any label, SSH2, or a PuTTY key file."""
    armour = rng.choice(["pem", "pem", "ssh2", "putty"])
    if armour == "pem":
        label = rng.choice(
            [
                "RSA PRIVATE KEY",
                "PRIVATE KEY",
                "EC PRIVATE KEY",
                "OPENSSH PRIVATE KEY",
                "ENCRYPTED PRIVATE KEY",
                "PGP PRIVATE KEY BLOCK",
                f"{vendor(rng).upper()} PRIVATE KEY",
            ]
        )
        return "\n".join(
            [
                f"-----BEGIN {label}-----",
                *_pem_body(rng, rng.randint(120, 900)),
                f"-----END {label}-----",
            ]
        )
    if armour == "ssh2":
        return "\n".join(
            [
                "---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----",
                'Comment: "rsa-key-20240301"',
                *_pem_body(rng, 600, 70),
                "---- END SSH2 ENCRYPTED PRIVATE KEY ----",
            ]
        )
    public, private = _pem_body(rng, 270, 64), _pem_body(rng, 660, 64)
    return "\n".join(
        [
            "PuTTY-User-Key-File-3: ssh-rsa",
            "Encryption: none",
            "Comment: rsa-key-20240301",
            f"Public-Lines: {len(public)}",
            *public,
            f"Private-Lines: {len(private)}",
            *private,
            f"Private-MAC: {pick(rng, '0123456789abcdef', 64)}",
        ]
    )


def planted_key(block: str) -> str:
    """What of a key block must not survive: its private part."""
    if block.startswith("PuTTY"):
        return block.split("Private-Lines:", 1)[1].split("\n", 1)[1].rsplit("\nPrivate-MAC", 1)[0]
    return "\n".join(block.split("\n")[1:-1])


def key_context(rng: random.Random, block: str, name: str) -> tuple[str, str, str]:
    """(channel, text, what must not survive) of a key block where a log holds it."""
    how = rng.choice(["raw", "python", "json", "kubeconfig", "k8s_secret", "encoded_setting"])
    if how == "raw":
        return "stdout", block, planted_key(block)
    if how == "python":
        return "python", f'{name} = """{block}"""', planted_key(block)
    if how == "json":
        esc = block.replace("\n", "\\n")
        return (
            "stdout",
            f'{{"type": "service_account", "{name}": "{esc}\\n"}}',
            planted_key(block).replace("\n", "\\n"),
        )
    encoded = base64.b64encode(block.encode()).decode()
    if how == "kubeconfig":
        cert = base64.b64encode(
            b"-----BEGIN CERTIFICATE-----\n"
            + base64.b64encode(rng.randbytes(600))
            + b"\n-----END CERTIFICATE-----\n"
        ).decode()
        return (
            "stdout",
            (
                f"users:\n- name: {vendor(rng)}\n  user:\n    client-certificate-data: {cert}\n"
                f"    client-key-data: {encoded}"
            ),
            encoded,
        )
    if how == "k8s_secret":
        return (
            "stdout",
            (
                f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {vendor(rng)}-tls\n"
                f"type: kubernetes.io/tls\ndata:\n  tls.key: {encoded}"
            ),
            encoded,
        )
    return "stdout", f"{vendor(rng)}_key_b64: {encoded}", encoded
