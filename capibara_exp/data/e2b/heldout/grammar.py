"""The contexts of the generated corpus: where E2B cells put a credential, as templates.

Each context is a line or block as a language, tool or library writes it, in the record
field it reaches (code of a language E2B runs, stdout, stderr, an error value, a
traceback, a result's text or HTML). `{k}` is a key name (tokens.render in one of the
context's case styles), `{s}` the value, `{v}`/`{V}` a made-up vendor word. A context
with a fixed cue (`login {s}`, `Client('{s}')`) names its counterpart without one, which
the negatives use; a context with a name slot uses a neutral name there instead.
"""

from __future__ import annotations

import dataclasses

CODE = ("snake", "camel", "screaming", "pascal")
CONFIG = ("snake", "camel", "kebab", "dotted", "flat")
ANY = ("snake", "camel", "screaming", "pascal", "kebab", "dotted", "flat")
_TB = (
    'Traceback (most recent call last):\n  File "<cell>", line 3, in <module>\n    {line}\n'
    '  File "/usr/lib/python3/site-packages/{v}/api.py", line 88, in request\n'
    "    raise {V}Error(resp.status_code)\n{V}Error: {last}"
)
_JS_FRAME = "/home/user/index.js:3\n{line}\n      ^\n\nTypeError: {{V}} is not a constructor"
_JAVA = 'Exception in thread "main" com.{{v}}.{message}\n\tat com.{{v}}.Client.call(Client.java:42)'
_ANSI = (
    "\x1b[0;31m---------------------------------------------------------------------------"
    "\x1b[0m\n\x1b[0;31m{V}Error\x1b[0m                            Traceback (most recent call "
    "last)\nCell \x1b[0;32mIn[4], line 3\x1b[0m\n\x1b[1;32m----> 3\x1b[0m client \x1b[38;5;241m="
    '\x1b[39m {v}\x1b[38;5;241m.\x1b[39m{call}(\x1b[38;5;124m"{s}\x1b[39m\x1b[38;5;124m"\x1b[39m)'
)


@dataclasses.dataclass(frozen=True)
class Context:
    cls: str  # the context class the tables report
    channel: str  # the record field and the language of code
    text: str
    styles: tuple[str, ...] = ANY  # case styles of `{k}`
    neutral: str | None = None  # the same context without a cue (fixed-cue contexts)
    slot: str = "token"  # "token", "chosen" (a password name), "block" (key material)


C = Context
CONTEXTS: tuple[Context, ...] = (
    # assignments in the code of every language E2B runs
    C("assign", "python", '{k} = "{s}"', CODE),
    C("assign", "python", 'client = {V}Client({k}="{s}", timeout=30)', ("snake",)),
    C("assign", "python", 'config = {{"{k}": "{s}", "region": "eu-west-1"}}'),
    C("assign", "python", 'os.environ["{k}"] = "{s}"', ("screaming",)),
    C("assign", "python", 'self.{k}: str = "{s}"', ("snake",)),
    C("assign", "javascript", "const {k} = '{s}';", ("camel", "screaming")),
    C("assign", "javascript", 'const client = new {V}({{ {k}: "{s}", retries: 3 }});', ("camel",)),
    C("assign", "typescript", 'const {k}: string = "{s}";', ("camel",)),
    C("assign", "java", 'String {k} = "{s}";', ("camel",)),
    C("assign", "java", 'props.setProperty("{k}", "{s}");', ("dotted", "snake")),
    C("assign", "r", '{k} <- "{s}"', ("snake", "dotted")),
    C("assign", "r", 'Sys.setenv({k} = "{s}")', ("screaming",)),
    C("assign", "bash", "export {k}={s}", ("screaming",)),
    C("assign", "bash", '{k}="{s}" ./deploy.sh --region eu', ("screaming",)),
    C("assign", "go", '{k} := "{s}"', ("camel",)),
    C("assign", "sql", "UPDATE settings SET {k} = '{s}' WHERE id = 1;", ("snake",)),
    C(
        "assign",
        "python",
        'password = "{s}"\ndb.connect(user="app", password=password)',
        (),
        slot="chosen",
    ),
    C("assign", "javascript", "const {k} = `{s}`;", ("camel",), slot="chosen"),
    # environment variables
    C("env", "stdout", "{k}={s}", ("screaming",)),
    C("env", "python", "%env {k}={s}", ("screaming",)),
    C("env", "bash", "docker run -d -e {k}={s} -p 8080:8080 app:latest", ("screaming",)),
    C(
        "env",
        "stdout",
        "environ({{'HOME': '/root', '{k}': '{s}', 'LANG': 'C.UTF-8'}})",
        ("screaming",),
    ),
    C("env", "stdout", 'declare -x {k}="{s}"', ("screaming",)),
    C("env", "stdout", "{k}={s}", ("screaming",), slot="chosen"),
    # settings files: YAML, tfvars, TOML, INI, JSON, properties, compose, Kubernetes
    C("config", "stdout", "{v}:\n  {k}: {s}\n  region: eu-west-1", CONFIG),
    C("config", "stdout", '{k} = "{s}"', ("snake",)),
    C("config", "stdout", '[{v}]\n{k} = "{s}"\ntimeout = 30', ("snake", "kebab")),
    C("config", "stdout", '{{"{k}": "{s}", "enabled": true}}', ANY),
    C("config", "stdout", "{v}.{k}={s}", ("dotted", "camel")),
    C(
        "config",
        "stdout",
        "    environment:\n      - {k}={s}\n      - LOG_LEVEL=info",
        ("screaming",),
    ),
    C(
        "config",
        "stdout",
        '        env:\n        - name: {k}\n          value: "{s}"',
        ("screaming",),
    ),
    C(
        "config",
        "stdout",
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {v}\ntype: Opaque\n"
        "stringData:\n  {k}: {s}",
        CONFIG,
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {v}\ndata:\n  {k}: {s}",
    ),
    C("config", "stdout", "{v}:\n  {k}: '{s}'", CONFIG, slot="chosen"),
    # command lines: flags, login subcommands, literals, headers
    C("cli", "bash", "{v}-cli --{k} {s} --region eu", ("kebab",)),
    C("cli", "bash", "{v} deploy --{k}={s}", ("kebab",)),
    C("cli", "bash", "{v} login {s}", (), "{v} checkout {s}"),
    C("cli", "bash", "ngrok config add-authtoken {s}", (), "ngrok config add-remote {s}"),
    C("cli", "python", "!{v} auth login --with-token {s}", (), "!{v} show --with-ref {s}"),
    C(
        "cli",
        "bash",
        "kubectl create secret generic {v} --from-literal={k}={s}",
        ("snake", "kebab"),
    ),
    C("cli", "bash", 'curl -s -H "{k}: {s}" https://api.{v}.io/v1/me', ("header",)),
    C("cli", "bash", "{v} configure set {k} {s}", ("snake",)),
    C(
        "cli",
        "bash",
        "ldapsearch -x -D cn=admin,dc=example,dc=org -w {s} -b dc=example,dc=org",
        (),
        "ldapsearch -x -D cn=admin,dc=example,dc=org -s {s} -b dc=example,dc=org",
        "chosen",
    ),
    C("cli", "bash", "mysql -h db -u root -p{s} shop < dump.sql", (), None, "chosen"),
    C("cli", "bash", "{v} --{k} {s}", ("kebab",), slot="chosen"),
    # positional arguments of calls whose callee says client, auth, login, key, token...
    C("call", "python", 'client = {V}Client("{s}")', (), 'image = {V}Image("{s}")'),
    C("call", "python", "client = {v}.Client('{s}')", (), "blob = {v}.Blob('{s}')"),
    C("call", "python", 'f = Fernet(b"{s}")', (), 'f = Path("{s}")'),
    C("call", "python", '{v}.login("{s}")', (), '{v}.lookup("{s}")'),
    C("call", "python", '{v}.set_api_key("{s}")', (), '{v}.set_commit("{s}")'),
    C(
        "call",
        "python",
        "sig = hmac.new(b'{s}', body, hashlib.sha256)",
        (),
        "sig = zlib.crc32(b'{s}')",
    ),
    C("call", "python", 'api = {V}("{s}")', (), 'obj = uuid.UUID("{s}")'),
    C(
        "call",
        "javascript",
        'const client = new {V}Client("{s}");',
        (),
        'const img = new {V}Image("{s}");',
    ),
    C("call", "typescript", "{v}.setToken('{s}');", (), "{v}.setRevision('{s}');"),
    C(
        "call",
        "java",
        'ApiClient client = new ApiClient("{s}");',
        (),
        'Digest d = new Digest("{s}");',
    ),
    C(
        "call",
        "java",
        'var creds = Credentials.fromToken("{s}");',
        (),
        'var ref = Refs.fromSha("{s}");',
    ),
    C("call", "r", '{v}_auth("{s}")', (), '{v}_fetch("{s}")'),
    C(
        "call",
        "python",
        'session.login("deploy", "{s}")',
        (),
        'session.fetch("deploy", "{s}")',
        "chosen",
    ),
    # error messages about authentication, tracebacks quoting the source line
    C(
        "error",
        "error",
        "401 Unauthorized: credential {s} is not valid",
        (),
        "404 Not Found: object {s} does not exist",
    ),
    C(
        "error",
        "error",
        "AuthenticationError: Incorrect API key provided: {s}",
        (),
        "LookupError: unknown object: {s}",
    ),
    C("error", "error", "{V}Error: invalid token '{s}'", (), "{V}Error: invalid revision '{s}'"),
    C(
        "error",
        "error",
        "PermissionDenied: 403 Forbidden (token={s})",
        (),
        "NotFound: 404 (object={s})",
    ),
    C(
        "error",
        "stderr",
        "ERROR:{v}:authentication failed for {s}",
        (),
        "ERROR:{v}:download failed for {s}",
    ),
    C(
        "error",
        "stderr",
        "WARNING:{v}.auth:token {s} expired, refreshing",
        (),
        "WARNING:{v}.cache:entry {s} expired, refreshing",
    ),
    C(
        "error",
        "error",
        "HTTPError: 401 Client Error: Unauthorized for url: https://api.{v}.io/v1/me?key={s}",
        (),
        "HTTPError: 404 Client Error: Not Found for url: https://api.{v}.io/v1/items/{s}",
    ),
    C(
        "traceback",
        "traceback",
        _TB.format(
            line='client = {V}Client(api_key="{s}")', v="{v}", V="{V}", last="401 Unauthorized"
        ),
        (),
        _TB.format(line='blob = {V}Blob(sha="{s}")', v="{v}", V="{V}", last="404 Not Found"),
    ),
    C(
        "traceback",
        "traceback",
        _TB.format(line='{k} = "{s}"', v="{v}", V="{V}", last="bad request"),
        CODE,
    ),
    C(
        "traceback",
        "traceback",
        _ANSI.format(call="Client", s="{s}", v="{v}", V="{V}"),
        (),
        _ANSI.format(call="Blob", s="{s}", v="{v}", V="{V}"),
    ),
    C(
        "traceback",
        "stderr",
        _JS_FRAME.format(line="const client = new {V}('{s}');"),
        (),
        _JS_FRAME.format(line="const blob = new {V}('{s}');"),
    ),
    C(
        "traceback",
        "stderr",
        _JAVA.format(message="AuthException: invalid token {s}"),
        (),
        _JAVA.format(message="NotFoundException: missing object {s}"),
    ),
    C(
        "traceback",
        "error",
        'Error in {v}_auth("{s}") : HTTP 401 unauthorized',
        (),
        'Error in {v}_get("{s}") : HTTP 404 not found',
    ),
    # headers and URLs
    C(
        "header",
        "python",
        'headers = {{"Authorization": "Bearer {s}", "Accept": "application/json"}}',
        (),
        'headers = {{"X-Request-Id": "{s}", "Accept": "application/json"}}',
    ),
    C(
        "header",
        "stderr",
        "> GET /v1/items HTTP/1.1\n> Authorization: {V} {s}\n> Accept: */*",
        (),
        "> GET /v1/items HTTP/1.1\n> If-None-Match: {s}\n> Accept: */*",
    ),
    C("header", "python", 'headers = {{"{k}": "{s}"}}', ("header",)),
    C("header", "stdout", "Set-Cookie: session={s}; Path=/; HttpOnly", (), "ETag: {s}; Path=/"),
    C(
        "url",
        "bash",
        "git clone https://{s}@git.{v}.io/team/repo.git",
        (),
        "git clone https://git.{v}.io/team/{s}.git",
    ),
    C("url", "stdout", "GET https://api.{v}.io/v1/items?{k}={s}&page=2 -> 200", ("snake", "camel")),
    C(
        "url",
        "javascript",
        "const ws = new WebSocket('wss://stream.{v}.io/socket?token={s}');",
        (),
        "const ws = new WebSocket('wss://stream.{v}.io/socket?build={s}');",
    ),
    C(
        "url",
        "python",
        'engine = create_engine("postgresql://app:{s}@db.{v}.io:5432/shop")',
        (),
        None,
        "chosen",
    ),
)
