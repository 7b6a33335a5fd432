"""Secret scrubbing: a context detector, measured on what it was not written from.

The goals are checked as the build gate checks them: credentials of formats nobody named
(random alphabets and structures) in generated contexts, each provider's tokens with that
provider's rules left out, the provider formats' held-out corpus, and must-survive text
harvested from this machine's files; and on other seeds. The principle is tested with
hypothesis over the grammar of contexts.
"""

from __future__ import annotations

import random
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capibara_exp.data.e2b import build, heldout, quarantine, scrub
from capibara_exp.data.e2b.heldout import credential_formats, generated, grammar, layouts, tokens


def _gate() -> dict:
    sc = build.default_config()["secret_scrubbing"]
    return {"seed": sc["seed"], "per": sc["samples_per_format"], "min": sc["min_recall"],
            "max_altered": sc["max_negatives_altered"], "sc": sc}


def test_goals_on_never_named_formats_and_with_each_family_left_out() -> None:
    g = _gate()
    report = build.scrubbing_report(g["sc"])
    assert build._below(g["sc"], report) == [], build._below(g["sc"], report)
    gen, lofo = report["generated"], report["leave_one_family_out"]
    assert gen["positives"] >= 3000 and gen["negatives"] >= 1500
    assert len(gen["recall_per_class"]) >= 10 and len(gen["recall_per_format"]) >= 30
    assert {"python", "javascript", "typescript", "r", "java", "bash", "sql"} <= set(
        gen["recall_per_channel"]
    )
    assert lofo["families"] >= 20 and lofo["worst_recall"] >= g["min"], lofo["recall"]


def test_the_goals_hold_on_seeds_the_detector_was_never_looked_at_with() -> None:
    gen = generated.evaluate(91, 1500, 800)
    assert gen["recall"] >= 0.99, [(p.cls, p.text[:120]) for p in gen["missed"][:5]]
    assert gen["negatives_altered_share"] <= 0.02, gen["altered_examples"][:3]
    lofo = generated.leave_one_family_out(91, 40)
    assert lofo["worst_recall"] >= 0.975, [(f, s.text[:120]) for f, s in lofo["missed"][:5]]


def test_goals_on_the_held_out_corpus_of_the_build_gate() -> None:
    g = _gate()
    report = heldout.evaluate(g["seed"], g["per"])
    assert report["formats"] >= 25 and report["negatives"] >= 300, report
    assert report["min_recall"] >= g["min"], (report["recall"], report["missed_channels"])
    assert report["negatives_altered_share"] <= g["max_altered"], heldout.altered_negatives(
        g["seed"]
    )[:5]
    channels = {p.channel for p in heldout.positives(g["seed"], 10)}
    assert channels == {"python", "javascript", "sql", "stdout", "stderr", "error", "traceback"}
    # the harvest found real files: hashes of RECORD files, images of installed packages
    assert report["negatives_per_category"]["record_hashes"] >= 30, report
    assert report["negatives_per_category"]["identifiers"] >= 30, report


def test_goals_hold_on_another_seed_and_detect_secrets_alone_does_not_meet_them() -> None:
    other = heldout.evaluate(91, 40)
    assert other["min_recall"] >= 0.975, heldout.missed_positives(91, 40)[:3]  # 1 miss of 40
    assert other["negatives_altered_share"] <= 0.02
    alone = heldout.evaluate(91, 40, own=False)  # the library without the project's patterns
    short = {k for k, v in alone["recall"].items() if v < 0.99}
    assert {"password_human", "duckdb_secret", "huggingface_token", "private_key"} <= short


def test_a_github_token_found_by_its_prefix_is_redacted_whole() -> None:
    # detect-secrets reports the regex group (`ghp`) for GitHub tokens: the token is widened
    token = credential_formats.github_token(random.Random(0), "ghp")
    text, counts = scrub.scrub_text(f"print('{token}'); ghpages = 1")
    assert token not in text and "ghpages = 1" in text and counts == {"github_token": 1}


@pytest.mark.parametrize(
    "text, secret",
    [  # the families the issue names, each in a form a real log has
        ("CREATE USER app WITH PASSWORD 'Tr0ub4dor&3';", "Tr0ub4dor&3"),
        ("ALTER USER 'root'@'localhost' IDENTIFIED BY 'c0rrect-h0rse';", "c0rrect-h0rse"),
        ("ALTER USER scott IDENTIFIED BY tiger77;", "tiger77"),
        ("r = redis.Redis.from_url('redis://:s3cr3t-pw@cache:6379/0')", "s3cr3t-pw"),
        ('client_secret: str = "GOCSPX-abcdEFGH1234ijkl"', "GOCSPX-abcdEFGH1234ijkl"),
        ("[database]\nhost = db\npassword = Winter2024\n", "Winter2024"),
        ("DB_PASSWORD=Winter2024\n", "Winter2024"),
        ("GET /v1/items?api_key=9f8e7d6c5b4a39281706&page=2", "9f8e7d6c5b4a39281706"),
        ("CREATE SECRET (TYPE s3, KEY_ID 'x', SECRET 'wJalrXUtn/K7MDENG+bPxRfiCY', REGION 'r');",
         "wJalrXUtn/K7MDENG+bPxRfiCY"),
        ('  File "<cell>", line 3, in <module>\n    db.connect(password="Harbor1887#")\n',
         "Harbor1887#"),
        ("ValueError: bad token hf_" + "AbCdEfGhIj" * 3 + "KlMn", "hf_" + "AbCdEfGhIj" * 3),
        ("mysql -u root -pS3cretPw shop", "S3cretPw"),
        ("E2B_API_KEY=e2b_" + "0123456789abcdef" * 2 + "01234567", "e2b_0123456789abcdef"),
    ],
)
def test_the_families_real_logs_carry(text: str, secret: str) -> None:
    scrubbed, counts = scrub.scrub_text(text)
    assert secret not in scrubbed and counts, scrubbed


@pytest.mark.parametrize(
    "text",
    [  # must survive: placeholders, references, ARNs, hashes, variable names
        'api_key = "YOUR_API_KEY"',
        'client = OpenAI(api_key="sk-...")',
        "password: ${DB_PASSWORD}",
        "DB_PASSWORD=$DB_PASSWORD",
        'secret_arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:prod/db-AbCdEf"',
        'SecretId="arn:aws:secretsmanager:eu-west-1:123456789012:secret:ci/token-x1Y2z3"',
        "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU",
        "password = getpass.getpass()",
        "token = tokenizer(x)",
        "pairs = sorted(counts.items(), key=lambda kv: kv[1])",
        "Access denied for user 'root'@'localhost' (using password: YES)",
        'aws_access_key_id = "AKIAIOSFODNN7EXAMPLE"',
    ],
)
def test_placeholders_and_names_survive(text: str) -> None:
    assert scrub.scrub_text(text)[0] == text
    assert scrub.scrub_text(text, "python")[0] == text


def test_a_secret_in_the_code_is_redacted_where_the_output_prints_it() -> None:
    record = {"code": 'password = "hunter2-Harbor"\nprint(password)', "stdout": "hunter2-Harbor\n"}
    clean, counts = scrub.scrub_tree(record, {("code",): "python"})
    assert "hunter2-Harbor" not in str(clean) and sum(counts.values()) == 2, clean


def test_in_code_a_bare_name_is_a_variable_but_inside_a_string_it_is_a_setting() -> None:
    assert scrub.scrub_text("password = new_password", "python")[0] == "password = new_password"
    code = 'cfg.read_string("""\n[db]\npassword = Harbor1887\n""")'
    assert "Harbor1887" not in scrub.scrub_text(code, "python")[0]
    dsn = 'psycopg2.connect("host=db user=app password=willow06")'
    assert "willow06" not in scrub.scrub_text(dsn, "python")[0]


# any script and symbol, numbers grouped with U+202F, emoji joined with U+200D
_unicode = st.lists(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
    | st.sampled_from(["1\u202f234\u202f567", "👩\u200d💻", "\u200f\u2066x\u2069", "\ufeff"]),
    max_size=6,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=_unicode)
def test_text_without_secrets_is_kept_character_for_character(text: str) -> None:
    # arbitrary Unicode (no keyword, no key shape can arise from it by chance here)
    scrubbed, counts = scrub.scrub_text(text)
    assert scrubbed == text or counts, (text, scrubbed)
    if not counts:
        assert scrubbed.encode("utf-8") == text.encode("utf-8")


def test_a_quarantine_excerpt_keeps_no_secret_even_cut_by_its_window() -> None:
    token = credential_formats.github_token(random.Random(1), "ghp")
    line = ('{"code": "' + "x" * 300 + token + '", "language": 5').encode()
    for offset in range(250, 420, 7):  # the window edge falls inside the token
        text = quarantine.excerpt(line, offset)
        assert all(token[i : i + 8] not in text for i in range(0, len(token) - 8, 4)), text


# ---- the principle, over the grammar: a never-named token in any cue context is caught;
# a hash or UUID in the same context without the cue is kept ----

_token_contexts = [c for c in grammar.CONTEXTS if c.slot == "token"]
# The detector's recall is a rate (>= 0.99, measured above on thousands of secrets): a
# property run draws other values on every run and would fail now and then on the rare
# token that reads as words. Derandomized, the draws are fixed and every one must pass.
_PRINCIPLE = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@_PRINCIPLE
@given(
    ctx=st.sampled_from(_token_contexts),
    alphabet=st.sampled_from(sorted(tokens.ALPHABETS)),
    structure=st.sampled_from(tokens.STRUCTURES),
    seed=st.integers(0, 2**32),
)
def test_a_token_of_a_provider_nobody_named_is_caught_in_every_cue_context(
    ctx, alphabet: str, structure: str, seed: int
) -> None:
    rng = random.Random(seed)
    value = tokens.token(rng, alphabet, structure)
    if structure == "uuid_built" and ctx.cls == "call" and tokens.UUID_ONLY.fullmatch(value):
        return  # a bare UUID passed to a constructor is an id as often (documented)
    if ctx.cls == "url":
        value = urllib.parse.quote(value, safe="")
    text = generated._fill(ctx, rng, value, tokens.key_words(rng, tokens.GENERATED_NOUNS), False)
    assert heldout.caught(generated.scrubbed(ctx.channel, text), value), text


@_PRINCIPLE
@given(ctx=st.sampled_from(_token_contexts), seed=st.integers(0, 2**32))
def test_a_hash_uuid_or_id_in_the_same_context_without_a_cue_is_kept(ctx, seed: int) -> None:
    rng = random.Random(seed)
    _, value = tokens.neutral_value(rng)
    text = generated._fill(ctx, rng, value, rng.choice(tokens.NEUTRAL_NOUNS), True)
    assert generated.scrubbed(ctx.channel, text) == text


_VENDOR_TOKEN = "qzv_live_" + "Tk8mW2xQ9rLp4ZbN7cYd3FhJ6sVg"  # a format nobody lists
_UUID_TOKEN = "qzv-3f2a9c1e-7b4d-4e8a-9f1c-2d3e4f5a6b7c"


@pytest.mark.parametrize(
    "text, language",
    [  # each context the issue names, with a token of a made-up provider
        (f"client = Client('{_VENDOR_TOKEN}')", "python"),
        ("f = Fernet(b'dGhpcyBpcyBhIHRlc3Qga2V5IGZvciBmZXJuZXQ9PQ==')", "python"),
        (f"   service                          api_key\n0  billing  {_VENDOR_TOKEN}", None),
        (f" name    | value\n---------+------\n api_key | {_VENDOR_TOKEN}\n(1 row)", None),
        (f"INSERT INTO settings (name, value) VALUES ('qzv_token', '{_VENDOR_TOKEN}');", "sql"),
        (f"401 Unauthorized: credential {_VENDOR_TOKEN} is not valid", None),
        ('Traceback (most recent call last):\n  File "<cell>", line 2, in <module>\n'
         f'    client = qzv.Client("{_VENDOR_TOKEN}")\nqzv.AuthError: 401', None),
        (f"qzv-cli --api-key {_VENDOR_TOKEN} deploy", "bash"),
        (f"qzv deploy --token={_VENDOR_TOKEN}", "bash"),
        (f"qzv login {_VENDOR_TOKEN}", "bash"),
        (f"ngrok config add-authtoken {_VENDOR_TOKEN}", "bash"),
        (f"kubectl create secret generic qzv --from-literal=key={_VENDOR_TOKEN}", "bash"),
        ("ldapsearch -x -D cn=admin,dc=org -w Harbor1887# -b dc=org", "bash"),
        (f"qzv:\n  stripeSecretKey: {_VENDOR_TOKEN}\n  region: eu", None),
        (f'qzv_api_key = "{_VENDOR_TOKEN}"', None),
        (f"kind: Secret\nstringData:\n  qzvApiKey: {_VENDOR_TOKEN}", None),
        (f'access_token="{_UUID_TOKEN}"', None),
        (f"Sys.setenv(QZV_TOKEN = '{_VENDOR_TOKEN}')", "r"),
        (f'String apiKey = "{_VENDOR_TOKEN}";', "java"),
        (f"const client = new QzvClient('{_VENDOR_TOKEN}');", "typescript"),
    ],
)
def test_the_contexts_the_issue_names(text: str, language) -> None:
    scrubbed, counts = scrub.scrub_text(text, language)
    for secret in (_VENDOR_TOKEN, _UUID_TOKEN, "Harbor1887#", "dGhpcyBpcyBhIHRlc3Qga2V5"):
        assert secret not in scrubbed, scrubbed
    assert counts, scrubbed


def test_key_material_in_every_armour() -> None:
    rng = random.Random(5)
    for _ in range(40):
        block = layouts.key_block(rng)
        channel, text, planted = layouts.key_context(rng, block, "private_key")
        assert heldout.caught(generated.scrubbed(channel, text), planted), text[:200]
    putty = layouts.key_block(random.Random(11))
    while not putty.startswith("PuTTY"):
        putty = layouts.key_block(rng)
    out = scrub.scrub_text(putty)[0]
    public = putty.split("Public-Lines:", 1)[1].split("\n")[1]
    assert public in out and layouts.planted_key(putty) not in out  # the public half stays


@pytest.mark.parametrize(
    "text",
    [  # must survive: publishable keys, references, placeholders, hashes, UUIDs, ids,
        # base64 images, public keys (each a kind the issue names)
        "STRIPE_PUBLISHABLE_KEY=pk_live_51HqLyjWDarjtT1zdp7dcxyzABC",
        "const stripe = Stripe('pk_test_TYooMQauvdEDq54NiTphI7jx');",
        "api_key: pk_live_51HqLyjWDarjtT1zdp7dcXyZ",
        "const apiKey = process.env.OPENAI_API_KEY;",
        "token: ${{ secrets.GITHUB_TOKEN }}",
        "export API_KEY=$API_KEY",
        "api_key = '<YOUR_TOKEN>'",
        'api_key = os.environ["OPENAI_API_KEY"]',
        'token <- Sys.getenv("QZV_TOKEN")',
        'String key = System.getenv("QZV_API_KEY");',
        "sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "request_id = '3f2a9c1e-7b4d-4e8a-9f1c-2d3e4f5a6b7c'",
        "user_id: 18446744073709551615",
        # a numpy doctest the collector runs: a type signature, not a signature key
        'np.lib.introspect.opt_func_info(func_name="add|abs", signature="float64|complex64")',
        '<img src="data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4'
        '2mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==">',
        "icon_key: data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJ",
        "ssh_key: ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
        " deploy@ci",
        "-----BEGIN PUBLIC KEY-----\n"
        "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEm3PfPdTxp4UoOXoyNgXx0ekXbuhJ\n"
        "-----END PUBLIC KEY-----",
        "    client-certificate-data: "
        "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUMvakNDQWVhZ0F3SUJBZ0lCQURBTkJna3Fo"
        "a2lHOXcwQkFRc0ZBREFWTVJNd0VRWURWUVFERXdwcmRXSmwKY201bGRHVnpNQjRYRFRJd01EUXdP"
        "VEl3TkRRMU1Gb1hEVE13TURRd056SXdORFExTUZvd0ZURVRNQkVHQTFVRQpBeE1LYTNWaVpYSnVa"
        "WFJsY3pDQ0FTSXdEUVlKS29aSWh2Y05BUUVCQlFBRGdnRVBBRENDQVFvQ2dnRUJBTTRGCi0tLS0t"
        "RU5EIENFUlRJRklDQVRFLS0tLS0K",
    ],
)
def test_what_must_survive_survives(text: str) -> None:
    assert scrub.scrub_text(text)[0] == text
    assert scrub.scrub_text(text, "python")[0] == text


def test_a_quarantine_excerpt_keeps_no_ldapsearch_password_whose_flag_it_cuts_off() -> None:
    line = ('{"code": "!ldapsearch -x -D cn=admin,dc=example,dc=org -w Harbor1887# -b '
            + "x" * 300 + '", "language": 7}').encode()
    for offset in range(60, 200, 9):  # the window may start after `-w`
        assert "Harbor1887" not in quarantine.excerpt(line, offset)
