"""`kvscope keys init|show|allow|trust`, the key files' modes, and what serve does without keys."""
from __future__ import annotations

import stat

import pytest
import zmq.auth

from kvscope.ipc import keys
from kvscope.main import main as kvscope


@pytest.fixture
def home(tmp_path, monkeypatch):
    """XDG folders in tmp_path: nothing touches the real home."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "config" / "kvscope" / "keys"


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_writes_both_pairs_with_private_modes_and_allows_its_own_client(home, capsys):
    assert keys.default_keys_dir() == home
    assert kvscope(["keys", "init"]) == 0
    out = capsys.readouterr().out
    for name in ("server", "client"):
        public, secret = zmq.auth.load_certificate(home / f"{name}.key_secret")
        assert secret and zmq.auth.load_certificate(home / f"{name}.key") == (public, None)
        assert mode(home / f"{name}.key_secret") == 0o600
        assert public.decode() in out and secret.decode() not in out  # secrets never printed
    assert mode(home) == 0o700 and mode(home / "allowed_clients") == 0o700
    client_public = keys.read_public(home / "client.key")
    assert client_public in keys.allowed_keys(home / "allowed_clients")
    server = keys.load_server_keys(home)
    client = keys.load_client_keys(home)
    assert client.server_public == server.public and client.public == client_public


def test_init_never_overwrites_without_force(home, capsys):
    assert kvscope(["keys", "init"]) == 0
    before = (home / "server.key_secret").read_bytes()
    assert kvscope(["keys", "init"]) == 2
    err = capsys.readouterr().err
    assert "exist" in err and "--force" in err and str(home / "server.key_secret") in err
    assert (home / "server.key_secret").read_bytes() == before
    old_client = keys.read_public(home / "client.key")
    assert kvscope(["keys", "init", "--force"]) == 0
    assert (home / "server.key_secret").read_bytes() != before
    assert mode(home / "server.key_secret") == 0o600
    # the replaced client key is no longer admitted (rotating keys is why one forces)
    allowed = keys.allowed_keys(home / "allowed_clients")
    assert old_client not in allowed and keys.read_public(home / "client.key") in allowed


def test_init_tightens_a_folder_that_others_could_read(home):
    home.mkdir(parents=True, mode=0o755)
    home.chmod(0o755)
    keys.init_keys(home)
    assert mode(home) == 0o700


def test_allow_adds_a_client_once_and_refuses_secret_and_garbage_files(home, tmp_path, capsys):
    other = tmp_path / "laptop"
    assert kvscope(["keys", "init"]) == 0
    assert kvscope(["keys", "init", "--keys", str(other)]) == 0
    laptop = keys.read_public(other / "client.key")
    assert laptop not in keys.allowed_keys(home / "allowed_clients")
    capsys.readouterr()
    assert kvscope(["keys", "allow", str(other / "client.key"), "--name", "laptop"]) == 0
    assert laptop.decode() in capsys.readouterr().out
    allowed = keys.allowed_keys(home / "allowed_clients")
    assert allowed[laptop] == "laptop.key"
    assert kvscope(["keys", "allow", str(other / "client.key")]) == 0  # again: no duplicate
    assert len(keys.allowed_keys(home / "allowed_clients")) == 2
    assert len(list((home / "allowed_clients").glob("*.key"))) == 2

    assert kvscope(["keys", "allow", str(other / "client.key_secret")]) == 2
    assert "secret" in capsys.readouterr().err
    junk = tmp_path / "junk.key"
    junk.write_text('curve\n    public-key = "not a key"\n')
    assert kvscope(["keys", "allow", str(junk)]) == 2
    assert "40-character" in capsys.readouterr().err
    assert kvscope(["keys", "allow", str(tmp_path / "missing.key")]) == 2
    assert "missing.key" in capsys.readouterr().err
    assert len(keys.allowed_keys(home / "allowed_clients")) == 2


def test_show_prints_public_keys_allowed_clients_and_known_engines(home, tmp_path, capsys):
    other = tmp_path / "gpu"
    keys.init_keys(home)
    keys.init_keys(other)
    assert kvscope(["keys", "trust", "gpu.example", str(other / "server.key")]) == 0
    capsys.readouterr()
    assert kvscope(["keys", "show"]) == 0
    out = capsys.readouterr().out
    for path in (home / "server.key", home / "client.key", other / "server.key"):
        assert keys.read_public(path).decode() in out
    for path in (home / "server.key_secret", home / "client.key_secret"):
        assert zmq.auth.load_certificate(path)[1].decode() not in out
    assert "gpu.example" in out and "local" in out
    # attaching to tcp://gpu.example:... checks that engine's key, not this machine's own
    attach = keys.client_keys_for("tcp://gpu.example:5570")
    assert attach.server_public == keys.read_public(other / "server.key")
    assert keys.client_keys_for("tcp://127.0.0.1:5570") is None  # loopback: plain by default
    assert keys.client_keys_for("tcp://127.0.0.1:5570", curve=True).server_public == \
        keys.read_public(home / "server.key")


def test_missing_or_readable_secret_keys_are_named_with_the_fix(home):
    with pytest.raises(keys.KeyFileError, match="kvscope keys init"):
        keys.load_client_keys(home)
    keys.init_keys(home)
    (home / "client.key_secret").chmod(0o644)
    with pytest.raises(keys.KeyFileError, match="other users"):
        keys.load_client_keys(home)


def test_serve_off_loopback_needs_server_keys_and_refuses_contradictions(home, capsys):
    from kvscope.engine.cli import serve as serve_cli

    assert serve_cli.main(["--host", "0.0.0.0", "--port", "0", "--allow-remote"]) == 2
    err = capsys.readouterr().err
    assert "no server keys" in err and "kvscope keys init" in err
    assert serve_cli.main(["--port", "0", "--auth", "curve", "--insecure"]) == 2
    assert "contradict" in capsys.readouterr().err
    assert serve_cli.main(["--port", "0", "--auth", "curve"]) == 2  # loopback, asked for keys
    assert "no server keys" in capsys.readouterr().err


def test_curve_is_the_default_off_loopback_and_insecure_warns(capsys):
    from argparse import Namespace

    from kvscope.engine.cli.auth import uses_curve, warn_plain_http

    def args(auth="auto", insecure=False):
        return Namespace(auth=auth, insecure=insecure)

    local, remote = ["tcp://127.0.0.1:5570", "ipc:///tmp/k"], ["tcp://0.0.0.0:5570"]
    assert uses_curve(args(), local) is False
    assert uses_curve(args(), local + remote) is True
    assert uses_curve(args("curve"), local) is True
    assert capsys.readouterr().err == ""
    assert uses_curve(args(insecure=True), remote) is False
    err = capsys.readouterr().err
    assert "WARNING" in err and "0.0.0.0" in err and "plain text" in err
    warn_plain_http(["tcp://127.0.0.1:9100"])
    assert capsys.readouterr().err == ""
    warn_plain_http(["tcp://0.0.0.0:9100"])
    assert "plain HTTP" in capsys.readouterr().err
