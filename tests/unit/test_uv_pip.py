"""scripts/uv_pip.py: uv installs with the indexes, links, constraints and network settings pip would use, and says
when a pip setting has no uv equivalent (scripts/bootstrap.sh then installs with pip)."""

from __future__ import annotations

import pytest

from tests.scripts import load_script

uv_pip = load_script("uv_pip")

# `pip config list` on the CI machine's kind: a config file, and PIP_* variables (":env:") over it
LISTING = """global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/local-wheels'
"""


def test_every_setting_reaches_uv_and_variables_override_files():
    args, env = uv_pip.uv_arguments(uv_pip.pip_settings(LISTING))
    assert args == ["--index-strategy", "unsafe-best-match",  # pip's choice: the best version over every index
                    "--constraints", "/etc/xdg/pip/constraints.txt",
                    "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
                    "--find-links", "/opt/local-wheels"]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


def test_the_install_section_overrides_global_and_other_commands_sections_are_ignored():
    listing = ("global.index-url='https://mirror-a/simple'\ninstall.index-url='https://mirror-b/simple'\n"
               "download.index-url='https://mirror-c/simple'\ninstall.no-index='false'\n:env:.pre='yes'\n"
               "global.trusted-host='mirror-a mirror-b'\nglobal.proxy='http://proxy:3128'\n")
    args, env = uv_pip.uv_arguments(uv_pip.pip_settings(listing))
    assert args == ["--index-strategy", "unsafe-best-match", "--index-url", "https://mirror-b/simple",
                    "--prerelease", "allow", "--allow-insecure-host", "mirror-a", "--allow-insecure-host", "mirror-b"]
    assert env == {"HTTPS_PROXY": "http://proxy:3128", "HTTP_PROXY": "http://proxy:3128"}
    args, _ = uv_pip.uv_arguments(uv_pip.pip_settings(":env:.no-index='1'\n"))
    assert "--no-index" in args


@pytest.mark.parametrize("line", ["global.only-binary=':all:'", "install.no-binary='torch'",
                                  ":env:.no-index='sometimes'", "global.use-feature='truststore'"])
def test_a_setting_without_a_uv_equivalent_is_named(line):
    with pytest.raises(uv_pip.Untranslatable, match=line.split(".", 1)[1].split("=")[0]):
        uv_pip.uv_arguments(uv_pip.pip_settings(LISTING + line + "\n"))


def test_check_fails_and_says_why_then_bootstrap_uses_pip(monkeypatch, capsys, tmp_path):
    fake_python = tmp_path / "bin" / "python"
    fake_python.parent.mkdir()
    (fake_python.parent / "uv").touch()
    monkeypatch.setattr(uv_pip.sys, "executable", str(fake_python))
    monkeypatch.setattr(uv_pip, "_pip_config_listing", lambda: LISTING)
    assert uv_pip.main(["check"]) == 0
    monkeypatch.setattr(uv_pip, "_pip_config_listing", lambda: LISTING + "global.only-binary=':all:'\n")
    assert uv_pip.main(["check"]) == 1
    assert "only-binary" in capsys.readouterr().err
    (fake_python.parent / "uv").unlink()
    monkeypatch.setattr(uv_pip, "_pip_config_listing", lambda: LISTING)
    assert uv_pip.main(["check"]) == 1
    assert "no uv at" in capsys.readouterr().err


def test_install_runs_uv_for_this_interpreter_with_the_settings(monkeypatch, tmp_path):
    fake_python = tmp_path / "bin" / "python"
    fake_python.parent.mkdir()
    (fake_python.parent / "uv").touch()
    monkeypatch.setattr(uv_pip.sys, "executable", str(fake_python))
    monkeypatch.setattr(uv_pip, "_pip_config_listing", lambda: LISTING)
    ran = {}
    monkeypatch.setattr(uv_pip.subprocess, "run", lambda cmd, env: ran.update(cmd=cmd, env=env) or
                        type("Done", (), {"returncode": 3})())
    assert uv_pip.main(["install", "-e", "/repo[dev]"]) == 3  # uv's own exit code
    assert ran["cmd"][:5] == [str(fake_python.parent / "uv"), "pip", "install", "--python", str(fake_python)]
    assert ran["cmd"][-2:] == ["-e", "/repo[dev]"]
    assert ran["env"]["UV_HTTP_TIMEOUT"] == "180"


def test_this_interpreters_own_pip_config_is_read():
    # the real `pip config list` of the interpreter running the tests parses (a value pip quotes in a way
    # literal_eval rejects would raise here); a setting of this machine's that uv lacks is a valid answer
    settings = uv_pip.pip_settings(uv_pip._pip_config_listing())
    try:
        args, _ = uv_pip.uv_arguments(settings)
    except uv_pip.Untranslatable:
        return
    assert args[:2] == ["--index-strategy", "unsafe-best-match"]
