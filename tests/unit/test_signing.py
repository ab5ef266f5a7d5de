"""`qualify sign` and `qualify verify --allowed-signers --signature`: a signature over an acceptance's digest, made and
checked by the real ssh-keygen (-Y sign / -Y verify) with keys made here. A good signature verifies; one by a key the
allowed signers do not list, in another namespace, or over an acceptance re-sealed after an edit does not (exit 1)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.signing import NAMESPACE, allowed_signer_line
from tests.unit.test_acceptance_chain import COMMITTED, PINNED, rewrite

ACCEPTANCE = COMMITTED / "acceptance" / "acceptance.json"
pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs OpenSSH's ssh-keygen")


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def make_key(where: Path, name: str) -> Path:
    key = where / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{name}@example.org", "-f", str(key)],
                   check=True)
    return key


@pytest.fixture
def keys(tmp_path) -> dict[str, Path]:
    """alice's and bob's keys, and an allowed_signers file that lists alice alone."""
    alice, bob = make_key(tmp_path, "alice"), make_key(tmp_path, "bob")
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(allowed_signer_line("alice@example.org", alice) + "\n")
    return {"alice": alice, "bob": bob, "allowed": allowed}


@pytest.fixture
def copy(tmp_path) -> Path:
    shutil.copytree(COMMITTED, tmp_path / "tiny-qwen3")
    return tmp_path / "tiny-qwen3" / "acceptance" / "acceptance.json"


def verify_signed(acceptance: Path, keys: dict[str, Path], signature: Path, *extra: str):
    return cli("verify", str(acceptance), "--partial", "--allowed-signers", str(keys["allowed"]), "--signature",
               str(signature), *extra)


def test_the_committed_acceptance_is_signed_and_verifies(keys, tmp_path):
    sig = tmp_path / "tiny-qwen3.sig"
    result = cli("sign", str(ACCEPTANCE), "--key", str(keys["alice"]), "--out", str(sig), "--identity",
                 "alice@example.org")
    assert result.exit_code == 0, result.output
    assert f"signed {PINNED} (namespace {NAMESPACE})" in result.output and sig.read_text().startswith(
        "-----BEGIN SSH SIGNATURE-----")
    public = Path(f"{keys['alice']}.pub").read_text().strip()
    assert f'allowed_signers line: alice@example.org namespaces="{NAMESPACE}" {public}' in result.output
    result = verify_signed(ACCEPTANCE, keys, sig)
    assert result.exit_code == 0, result.output
    assert f"OK signature {sig}: a good signature of {PINNED} by alice@example.org" in " ".join(result.output.split())
    assert verify_signed(ACCEPTANCE, keys, sig, "--identity", "alice@example.org").exit_code == 0
    checked = json.loads(verify_signed(ACCEPTANCE, keys, sig, "--format", "json").output)["signature"]
    assert checked == {"ok": True, "digest": PINNED, "signature": str(sig), "namespace": NAMESPACE,
                       "signer": "alice@example.org", "problem": None}
    # the digest is what is signed: the same bytes as ssh-keygen itself signs them, checked by ssh-keygen alone
    done = subprocess.run(["ssh-keygen", "-Y", "verify", "-f", str(keys["allowed"]), "-I", "alice@example.org", "-n",
                           NAMESPACE, "-s", str(sig)], input=PINNED, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_signature_by_a_key_the_signers_do_not_list_fails(keys, copy):
    result = cli("sign", str(copy), "--key", str(keys["bob"]))
    assert result.exit_code == 0, result.output
    sig = Path(f"{copy}.sig")  # the default: beside the acceptance
    result = verify_signed(copy, keys, sig)
    assert result.exit_code == 1 and f"no identity in {keys['allowed']} holds the key that made it" in result.output
    # bob's signature claimed as alice's: ssh-keygen refuses it
    result = verify_signed(copy, keys, sig, "--identity", "alice@example.org")
    assert result.exit_code == 1 and "is not a good signature of" in result.output and "by alice@example.org" in \
        result.output
    # alice's good signature, but the identity asked for is not hers
    assert cli("sign", str(copy), "--key", str(keys["alice"])).exit_code == 0
    assert verify_signed(copy, keys, sig).exit_code == 0
    assert verify_signed(copy, keys, sig, "--identity", "bob@example.org").exit_code == 1


def test_a_signature_in_another_namespace_fails(keys, copy, tmp_path):
    """alice's key signing the same digest for another use (a git commit's namespace) is not an acceptance signature."""
    done = subprocess.run(["ssh-keygen", "-Y", "sign", "-f", str(keys["alice"]), "-n", "git"], input=PINNED,
                          capture_output=True, text=True, check=True)
    (tmp_path / "git.sig").write_text(done.stdout)
    result = verify_signed(copy, keys, tmp_path / "git.sig")
    assert result.exit_code == 1 and "is not a good signature of" in result.output


def test_a_resealed_acceptance_verifies_by_itself_and_fails_the_signature(keys, copy):
    """A bound raised with its control error (so it still follows from the rule), the bound file's digest and the
    acceptance's own recomputed: `verify` passes it, the signature over the frozen digest does not."""
    assert cli("sign", str(copy), "--key", str(keys["alice"])).exit_code == 0
    doc = json.loads(copy.read_text())
    name = "actor-fp32-repeat.json"
    file = copy.parent / "bounds" / name
    bounds = json.loads(file.read_text())
    entry = bounds["bounds"]["step1/grads/lm_head.weight"]["max_abs"]
    entry["control_error"] *= 100
    entry["bound"] = bounds["k"] * entry["control_error"] + entry["floor"] + entry["quantum"]
    file.write_text(json.dumps(bounds))
    doc["bounds"][name] = "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()
    rewrite(copy, doc)
    resealed = json.loads(copy.read_text())["digest"]
    assert resealed != PINNED
    alone = cli("verify", str(copy), "--partial")
    assert alone.exit_code == 0, alone.output  # self-consistent: only an anchor outside the run tells
    result = verify_signed(copy, keys, Path(f"{copy}.sig"))
    assert result.exit_code == 1, result.output
    assert f"is not a good signature of {resealed} by alice@example.org" in " ".join(result.output.split())


def test_without_ssh_keygen_each_command_says_so_in_one_line(keys, copy, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for args in (["sign", str(copy), "--key", str(keys["alice"])],
                 ["verify", str(copy), "--partial", "--allowed-signers", str(keys["allowed"]), "--signature",
                  str(keys["allowed"])]):
        result = cli(*args)
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert "ssh-keygen not found on PATH" in result.output


def test_bad_input_is_one_line_and_exit_2(keys, copy, tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.bin").write_bytes(b"a")
    assert cli("manifest", "create", str(tmp_path / "e"), "--out", str(tmp_path / "m.json")).exit_code == 0
    for args, says in (
            (["sign", str(tmp_path / "m.json"), "--key", str(keys["alice"])], "not an acceptance"),
            (["sign", str(copy), "--key", str(tmp_path / "nokey")], "key"),
            (["sign", str(copy), "--key", str(keys["alice"]), "--out", str(tmp_path / "no" / "x.sig")],
             "does not exist"),
            (["sign", str(copy), "--key", str(keys["allowed"])], "ssh-keygen could not sign"),
            (["verify", str(copy), "--partial", "--signature", str(keys["allowed"])], "go together"),
            (["verify", str(copy), "--partial", "--allowed-signers", str(keys["allowed"]), "--signature",
              str(tmp_path / "none.sig")], "--signature"),
    ):
        result = cli(*args)
        assert result.exit_code == 2 and result.output.count("\n") == 1 and says in result.output, (args,
                                                                                                   result.output)
