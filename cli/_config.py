"""``--command-config``: Java client properties files, mapped to confluent-kafka settings.

Operators already have a ``client.properties`` for Apache Kafka's own tools
(``kafka-transactions.sh --command-config``).  Accepting the same file means
one set of credentials for both; this module reads it and maps the Java names
to the librdkafka dialect that :class:`kafka2pc.TransactionAdmin` takes.

What is mapped, and what is refused (with a message saying what to do):

* ``security.protocol``, ``sasl.mechanism``, ``ssl.*.location`` (librdkafka
  names), ``ssl.key.password``, ``client.id`` and everything else: passed through.
  The control plane then refuses any *security* setting it cannot honour, by
  name -- connecting with weaker security than asked must never happen silently.
* ``sasl.jaas.config`` with ``PlainLoginModule`` or ``ScramLoginModule``:
  its ``username``/``password`` become ``sasl.username``/``sasl.password``.
  Other login modules (Kerberos, OAuth) are refused.
* ``ssl.truststore.location`` with ``ssl.truststore.type=PEM``: becomes
  ``ssl.ca.location``.  JKS/PKCS12 key and trust stores cannot be read by
  librdkafka: refused, with the PEM settings to use instead.
* ``ssl.endpoint.identification.algorithm=`` (empty, Java's "off"): ``none``.

Pure Python, no client library: it is imported by ``kafka2pc --help``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kafka2pc import UsageError

__all__ = ["CommandConfigError", "client_config", "parse_jaas_credentials", "read_properties"]


class CommandConfigError(UsageError):
    """The ``--command-config`` file is unreadable, malformed, or asks for something unsupported."""


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _unescape(text: str, where: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "\\":
            out.append(char)
            i += 1
            continue
        if i + 1 >= len(text):
            break  # a lone trailing backslash (continuations are joined before)
        nxt = text[i + 1]
        if nxt == "u":
            digits = text[i + 2 : i + 6]
            if not re.fullmatch(r"[0-9a-fA-F]{4}", digits):
                raise CommandConfigError(f"{where}: malformed \\u escape {text[i : i + 6]!r}")
            out.append(chr(int(digits, 16)))
            i += 6
            continue
        out.append(_ESCAPES.get(nxt, nxt))
        i += 2
    return "".join(out)


def _ends_with_continuation(line: str) -> bool:
    backslashes = len(line) - len(line.rstrip("\\"))
    return backslashes % 2 == 1


def _split_key_value(line: str) -> tuple[str, str] | None:
    """Split at the first unescaped ``=`` or ``:``; ``None`` if there is none."""
    i = 0
    while i < len(line):
        char = line[i]
        if char == "\\":
            i += 2
            continue
        if char in "=:":
            return line[:i].rstrip(), line[i + 1 :].lstrip()
        i += 1
    return None


def read_properties(path: str | Path) -> dict[str, str]:
    """Read a Java ``.properties`` file (``key=value`` or ``key: value`` lines).

    Comments (``#``, ``!``), blank lines, backslash line continuations and the
    usual escapes are handled as ``java.util.Properties`` does.  A line without
    ``=`` or ``:`` is refused (Java would read it as a key with an empty value,
    which in a client config is always a typo), naming the file and line.

    >>> import tempfile, os
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".properties", delete=False)
    >>> _ = f.write("# comment\\nsecurity.protocol = SASL_SSL\\nsasl.mechanism: PLAIN\\n"); f.close()
    >>> read_properties(f.name)
    {'security.protocol': 'SASL_SSL', 'sasl.mechanism': 'PLAIN'}
    >>> os.unlink(f.name)
    """
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CommandConfigError(f"--command-config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandConfigError(f"--command-config {path}: cannot read it ({exc})") from exc

    props: dict[str, str] = {}
    logical = ""
    start_line = 0
    for number, physical in enumerate(raw.splitlines(), start=1):
        text = physical.lstrip() if logical else physical.strip()
        if not logical:
            if not text or text[0] in "#!":
                continue
            start_line = number
        if _ends_with_continuation(text):
            logical += text[:-1]
            continue
        logical += text.rstrip()
        where = f"--command-config {path}, line {start_line}"
        pair = _split_key_value(logical)
        logical = ""
        if pair is None:
            raise CommandConfigError(f"{where}: expected 'key=value', got {physical.strip()!r}")
        key, value = _unescape(pair[0], where), _unescape(pair[1], where)
        if not key:
            raise CommandConfigError(f"{where}: empty property name")
        props[key] = value
    if logical:
        raise CommandConfigError(f"--command-config {path}, line {start_line}: continuation at end of file")
    return props


_JAAS_RE = re.compile(
    r"^\s*(?P<module>[\w.$]+)\s+(?P<flag>required|requisite|sufficient|optional)\s*(?P<options>.*?)\s*;\s*$",
    re.DOTALL,
)
_JAAS_OPTION_RE = re.compile(r'\s*([\w.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s";]+))\s*')
_JAAS_MODULES = {
    "org.apache.kafka.common.security.plain.PlainLoginModule": "PLAIN",
    "org.apache.kafka.common.security.scram.ScramLoginModule": "SCRAM",
}


def parse_jaas_credentials(jaas: str) -> tuple[str, str, str]:
    """``(mechanism family, username, password)`` from a ``sasl.jaas.config`` value.

    The family is ``"PLAIN"`` or ``"SCRAM"`` (SCRAM-SHA-256 or -512 is
    ``sasl.mechanism``'s business).

    >>> parse_jaas_credentials('org.apache.kafka.common.security.plain.PlainLoginModule '
    ...                        'required username="alice" password="s3cr\\\\"et";')
    ('PLAIN', 'alice', 's3cr"et')
    """
    match = _JAAS_RE.match(jaas)
    if match is None:
        raise CommandConfigError(
            "sasl.jaas.config: expected '<LoginModule class> required username=\"...\" password=\"...\";'"
        )
    module = match["module"]
    family = _JAAS_MODULES.get(module)
    if family is None:
        raise CommandConfigError(
            f"sasl.jaas.config uses {module}, which the kafka2pc CLI cannot map to librdkafka "
            "(supported: PlainLoginModule, ScramLoginModule; for other mechanisms give the "
            "librdkafka settings directly, e.g. sasl.username/sasl.password)"
        )
    options: dict[str, str] = {}
    rest = match["options"]
    position = 0
    while position < len(rest):
        option = _JAAS_OPTION_RE.match(rest, position)
        if option is None or option.end() == position:
            raise CommandConfigError(f"sasl.jaas.config: cannot parse the options near {rest[position:][:30]!r}")
        quoted, bare = option[2], option[3]
        options[option[1]] = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare
        position = option.end()
    missing = [name for name in ("username", "password") if name not in options]
    if missing:
        raise CommandConfigError(f"sasl.jaas.config: {module} needs {' and '.join(missing)}")
    return family, options["username"], options["password"]


# Java-only key/trust store settings: meaningless once the *.location settings are mapped.
_STORE_COMPANIONS = frozenset(
    {"ssl.truststore.password", "ssl.truststore.type", "ssl.keystore.password", "ssl.keystore.type"}
)


def client_config(bootstrap_servers: str | None, properties: Mapping[str, str]) -> dict[str, Any]:
    """The confluent-kafka style config for :class:`kafka2pc.TransactionAdmin`.

    ``bootstrap_servers`` (from ``--bootstrap-server``) wins over a
    ``bootstrap.servers`` line in the properties file.

    >>> client_config("k:9092", {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
    ...     "sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
    ...                         'username="ops" password="pw";'})
    {'bootstrap.servers': 'k:9092', 'security.protocol': 'SASL_SSL', 'sasl.mechanism': 'SCRAM-SHA-512', \
'sasl.username': 'ops', 'sasl.password': 'pw'}
    """
    props = dict(properties)
    config: dict[str, Any] = {}
    bootstrap = bootstrap_servers or props.pop("bootstrap.servers", None)
    props.pop("bootstrap.servers", None)
    if not bootstrap:
        raise CommandConfigError(
            "no bootstrap server: pass --bootstrap-server HOST:PORT, set KAFKA_BOOTSTRAP_SERVERS, "
            "or put bootstrap.servers in the --command-config file"
        )
    config["bootstrap.servers"] = bootstrap

    jaas = props.pop("sasl.jaas.config", None)
    truststore = props.pop("ssl.truststore.location", None)
    truststore_type = props.get("ssl.truststore.type", "JKS").strip().upper()
    keystore = props.pop("ssl.keystore.location", None)
    for key in ("ssl.truststore.certificates", "ssl.keystore.certificate.chain", "ssl.keystore.key"):
        if key in props:
            raise CommandConfigError(
                f"{key} (inline PEM) is not supported by the kafka2pc CLI: put the PEM in a file and set "
                "ssl.ca.location (CA), ssl.certificate.location and ssl.key.location (client)"
            )
    if keystore is not None:
        raise CommandConfigError(
            f"ssl.keystore.location={keystore}: librdkafka cannot read Java keystores; export the client "
            "certificate and key to PEM files and set ssl.certificate.location and ssl.key.location "
            "(and ssl.key.password if the key is encrypted)"
        )
    if truststore is not None:
        if truststore_type != "PEM":
            raise CommandConfigError(
                f"ssl.truststore.location={truststore} is a {truststore_type} truststore, which librdkafka "
                "cannot read; export the CA certificate to PEM (keytool -exportcert -rfc -keystore ... "
                "-file ca.pem) and set ssl.ca.location=ca.pem instead"
            )
        config["ssl.ca.location"] = truststore
    for key in _STORE_COMPANIONS:
        props.pop(key, None)

    for key, value in props.items():
        if key == "ssl.endpoint.identification.algorithm":
            config[key] = value.strip().lower() or "none"
        elif key in ("security.protocol", "sasl.mechanism", "sasl.mechanisms"):
            config["sasl.mechanism" if key == "sasl.mechanisms" else key] = value.strip().upper()
        else:
            config[key] = value

    if jaas is not None:
        family, username, password = parse_jaas_credentials(jaas)
        mechanism = config.get("sasl.mechanism")
        if mechanism is None:
            if family == "SCRAM":
                raise CommandConfigError(
                    "sasl.jaas.config uses ScramLoginModule: set sasl.mechanism=SCRAM-SHA-256 or SCRAM-SHA-512"
                )
            config["sasl.mechanism"] = mechanism = "PLAIN"
        if not str(mechanism).startswith(family):
            raise CommandConfigError(
                f"sasl.mechanism={mechanism} does not match the login module of sasl.jaas.config ({family})"
            )
        config["sasl.username"] = username
        config["sasl.password"] = password
    return config
