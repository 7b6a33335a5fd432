"""Where credentials stand in execution logs: the held-out corpus's contexts.

Each context is a line or block as a library, tool or service prints or documents it
(boto3 and the AWS CLI's credentials file, libpq connection strings, the SQL of
PostgreSQL, MySQL, SQL Server, Oracle and DuckDB, curl, docker, redis-cli, sshpass, .env
files, YAML and INI settings, Python tracebacks and logging lines), placed in the record
field it would reach: the cell's code (python, javascript, sql), stdout, stderr, the
error's value or its traceback. `{s}` is the credential, `{env}` and `{kwarg}` the names
its issuer documents for it.
"""

from __future__ import annotations

import random
import urllib.parse

from capibara_exp.data.e2b.heldout.credential_formats import Format

CHANNELS = ("python", "javascript", "sql", "stdout", "stderr", "error", "traceback")

_FRAME = (
    "Traceback (most recent call last):\n"
    '  File "<cell>", line 4, in <module>\n'
    "    {line}\n"
    '  File "/usr/lib/python3/site-packages/client/api.py", line 212, in request\n'
    "    raise APIError(response.status_code, response.text)\n"
    "{last}"
)

# group -> [(channel, template)]
GROUPS: dict[str, list[tuple[str, str]]] = {
    "assign": [
        ("python", 'client = Client({kwarg}="{s}")'),
        ("python", '{kwarg} = "{s}"\nclient = connect({kwarg}={kwarg})'),
        ("python", 'os.environ["{env}"] = "{s}"'),
        ("python", "settings = {{'host': 'db.internal', '{kwarg}': '{s}', 'timeout': 30}}"),
        ("python", '{kwarg}: str = "{s}"'),
        ("python", 'self.{kwarg}: Final[str] = "{s}"'),
        ("javascript", "const client = new Client({{ {camel}: '{s}', retries: 3 }});"),
        ("javascript", 'process.env.{env} = "{s}";'),
        ("javascript", 'const {camel}: string = "{s}";'),
    ],
    "env": [
        ("stdout", "{env}={s}"),
        ("stdout", "export {env}={s}"),
        ("stdout", 'export {env}="{s}"'),
        ("python", "!{env}={s} python train.py --epochs 3"),
        ("python", "%env {env}={s}"),
        ("stdout", "docker run -d -e {env}={s} -p 8080:8080 app:latest"),
    ],
    "config": [
        ("stdout", "database:\n  host: db.internal\n  {kwarg}: {s}\n  port: 5432"),
        ("stdout", '  {kwarg}: "{s}"'),
        ("stdout", "[service]\nhost = api.internal\n{kwarg} = {s}"),
        ("python", 'cfg.read_string("""\n[service]\n{kwarg} = {s}\n""")'),
        ("stdout", "{{'host': 'db.internal', '{kwarg}': '{s}'}}"),
        ("stdout", '{{"user": "svc", "{kwarg}": "{s}"}}'),
        ("stdout", "environ({{'HOME': '/root', '{env}': '{s}', 'LANG': 'C.UTF-8'}})"),
    ],
    "log": [
        ("stderr", "DEBUG:client.auth:using {kwarg}={s}"),
        ("stderr", "WARNING:root:retrying GET /v1/items ({kwarg}={s}), attempt 2 of 5"),
    ],
    "url_query": [
        ("stdout", "GET https://api.example.com/v1/items?{kwarg}={s}&page=2 -> 200"),
        (
            "error",
            "401 Client Error: Unauthorized for url: https://api.example.com/v1/me?{kwarg}={s}",
        ),
        ("python", 'requests.get("https://api.example.com/v2/search?q=x&{kwarg}={s}")'),
    ],
    "freeform": [  # only the token's own shape gives it away
        ("stdout", "token in use: {s}"),
        ("stderr", "INFO:sdk:authenticated as ci-bot ({s})"),
        ("error", "Invalid credentials: {s}"),
        ("python", "keys = ['{s}']\nprint(len(keys))"),
        ("stdout", "['{s}']"),
    ],
    "traceback": [
        (
            "traceback",
            _FRAME.format(line='client = Client({kwarg}="{s}")', last="APIError: 401 Unauthorized"),
        ),
        (
            "traceback",
            _FRAME.format(
                line="resp = session.get(url, headers=headers)",
                last="APIError: 403 Forbidden: {kwarg}={s} is revoked",
            ),
        ),
    ],
    "sql_ddl": [
        ("sql", "CREATE ROLE app_rw WITH LOGIN PASSWORD '{s}';"),
        ("sql", "ALTER USER analytics WITH ENCRYPTED PASSWORD '{s}' VALID UNTIL '2026-01-01';"),
        ("sql", "CREATE USER 'app'@'%' IDENTIFIED BY '{s}';"),
        ("sql", "ALTER USER 'root'@'localhost' IDENTIFIED WITH mysql_native_password BY '{s}';"),
        ("sql", "SET PASSWORD FOR 'report'@'10.0.%' = '{s}';"),
        ("sql", 'CREATE USER app_owner IDENTIFIED BY "{s}" DEFAULT TABLESPACE users;'),
        ("sql", "CREATE LOGIN etl_user WITH PASSWORD = '{s}', CHECK_POLICY = ON;"),
        ("python", "cur.execute(\"ALTER ROLE app_rw PASSWORD '{s}'\")"),
    ],
    "sql_dml": [
        (
            "sql",
            "INSERT INTO users (name, email, password) VALUES ('bob', 'bob@example.com', '{s}');",
        ),
        ("sql", "UPDATE accounts SET password = '{s}', updated_at = now() WHERE id = 7;"),
        (
            "sql",
            "INSERT INTO service_credentials (service, api_secret, created)\n"
            "VALUES ('billing', '{s}', CURRENT_DATE);",
        ),
    ],
    "cli": [
        ("python", "!mysql -u root -p{s} -h 127.0.0.1 shop < dump.sql"),
        ("python", "!PGPASSWORD='{s}' psql -h db -U app -c 'select 1'"),
        ("python", 'subprocess.run(["sshpass", "-p", "{s}", "ssh", "deploy@10.0.0.5", "uptime"])'),
        ("stdout", "+ redis-cli -h cache -a {s} ping"),
        ("stdout", "$ curl -u admin:{s} https://ci.example.com/api/json"),
        ("python", "!docker login -u deploy -p {s} registry.example.com"),
        ("stdout", "+ mysqldump --user=backup --password={s} shop"),
        ("stderr", "+ mongosh --username app --password {s} --authenticationDatabase admin"),
    ],
    "conn_url": [
        ("python", 'engine = create_engine("postgresql://app:{u}@db.internal:5432/shop")'),
        ("python", 'r = redis.Redis.from_url("redis://:{u}@cache:6379/0")'),
        ("javascript", "await mongoose.connect('mongodb+srv://app:{u}@cluster0.example.net/db');"),
        ("stderr", "INFO:kombu:Connected to amqp://worker:{u}@rabbit:5672//"),
        ("error", "could not connect to server: postgresql://app:{u}@db.internal:5432/shop"),
        ("python", 'conn = psycopg2.connect("host=db dbname=shop user=app password={s}")'),
    ],
    "aws_ini": [
        (
            "stdout",
            "[default]\naws_access_key_id = {pair_id}\naws_secret_access_key = {s}\n"
            "region = us-east-1",
        ),
        (
            "python",
            'boto3.client("s3", aws_access_key_id="{pair_id}", aws_secret_access_key="{s}")',
        ),
    ],
    "git_url": [
        ("python", "!git clone https://oauth2:{s}@gitlab.example.com/team/repo.git"),
        ("stderr", "fatal: unable to access 'https://{s}@github.com/org/repo.git/': 403"),
    ],
    "npmrc": [("stdout", "//registry.npmjs.org/:_authToken={s}")],
    "bearer": [
        ("python", "!curl -H 'Authorization: Bearer {s}' https://api.example.com/v1/items"),
        ("python", 'headers = {{"Authorization": f"Bearer {s}", "Accept": "application/json"}}'),
        ("stderr", "send: b'GET /v1/items HTTP/1.1\\r\\nAuthorization: Bearer {s}\\r\\n'"),
    ],
    "basic": [
        ("python", '!curl -H "Authorization: Basic {s}" https://api.internal/v2/orders'),
        ("python", 'headers = {{"Authorization": "Basic {s}"}}'),
        ("stderr", "> Authorization: Basic {s}"),
    ],
    "pem": [
        ("python", 'key = """{s}"""'),
        ("stdout", "{s}"),
        ("python", 'info = {{"type": "service_account", "private_key": "{esc}"}}'),
    ],
    "azure_conn": [
        (
            "python",
            'conn = "DefaultEndpointsProtocol=https;AccountName=prodlogs;'
            'AccountKey={s};EndpointSuffix=core.windows.net"',
        ),
        (
            "stdout",
            "AZURE_STORAGE_CONNECTION_STRING=DefaultEndpointsProtocol=https;"
            "AccountName=prodlogs;AccountKey={s}",
        ),
    ],
    "azure_sas": [
        (
            "python",
            'url = "https://acct.blob.core.windows.net/logs/app.csv?sv=2022-11-02'
            '&ss=b&srt=o&sp=r&se=2026-01-01T00:00:00Z&spr=https&sig={s}"',
        ),
        ("stderr", "DEBUG:azure:GET /logs/app.csv?sv=2022-11-02&sp=r&sig={s} 200"),
    ],
    "duckdb": [
        (
            "sql",
            "CREATE SECRET s3_prod (TYPE s3, KEY_ID '{pair_id}', SECRET '{s}', "
            "REGION 'eu-west-1');",
        ),
        (
            "sql",
            "CREATE PERSISTENT SECRET (\n    TYPE s3,\n    KEY_ID '{pair_id}',\n"
            "    SECRET '{s}'\n);",
        ),
        ("python", "duckdb.sql(\"CREATE SECRET (TYPE gcs, KEY_ID 'svc', SECRET '{s}')\")"),
    ],
}
# Which groups each family of formats appears in.
FAMILY_GROUPS = {
    "token": ("assign", "env", "config", "log", "url_query", "freeform", "traceback"),
    "opaque": ("assign", "env", "config", "log", "traceback"),
    "password": ("assign", "env", "config", "traceback", "sql_ddl", "sql_dml", "cli", "conn_url"),
    "header": (),
    "sas": (),
    "duckdb": (),
}


_BEFORE = {
    "python": ["", "import os\n", "# settings\n", "x = 1\n"],
    "javascript": ["", "const a = 2;\n", "// config\n"],
}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def place(fmt: Format, secret: str, rng: random.Random) -> tuple[str, str, str]:
    """(text, channel, the credential as it stands in the text) for one sample."""
    groups = FAMILY_GROUPS[fmt.family] + fmt.extra
    channel, template = rng.choice([c for g in sorted(groups) for c in GROUPS[g]])
    encoded = urllib.parse.quote(secret, safe="")
    pair_id = "AKIA" + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567") for _ in range(16))
    text = template.format(
        s=secret,
        u=encoded,
        esc=secret.replace("\n", "\\n"),
        env=fmt.env,
        kwarg=fmt.kwarg,
        camel=_camel(fmt.kwarg),
        pair_id=pair_id,
    )
    planted = encoded if "{u}" in template else secret
    if "{esc}" in template:
        planted = secret.replace("\n", "\\n")
    if channel in _BEFORE:
        text = rng.choice(_BEFORE[channel]) + text
    return text, channel, planted
