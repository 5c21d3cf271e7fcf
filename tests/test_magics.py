"""%%kinetic in a real IPython shell: parsing, one-line usage errors, Out[n] and --out."""

from __future__ import annotations

import pathlib
import re

import pytest
from IPython.core.interactiveshell import InteractiveShell

import kinetic_nb
from kinetic_nb.accelerators import accelerator_names


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext kinetic_nb", store_history=True)
    yield shell
    InteractiveShell.clear_instance()


def run_cell(shell, code):
    return shell.run_cell(code, store_history=True)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("-n abc", "argument -n/--hosts: invalid int value: 'abc'"),
        ("-n 0", "-n/--hosts must be at least 1, got 0"),
        ("--framework tensorflow", "argument --framework: invalid choice: 'tensorflow'"),
        ("-a tpu-v5e-12", "unknown accelerator 'tpu-v5e-12'"),
        ("-a tpu-v5e-16 -n 2", "2 hosts do not match tpu-v5e-16, which has 4 hosts"),
        ("-e NOVALUE", "-e/--env expects KEY=VALUE, got 7 characters with no KEY= before them"),  # may be the secret
        ("-o 1x", "-o/--out expects variable names, got '1x'"),
        ("--timeout -1", "--timeout must be a positive number of seconds, got -1"),
        ("--timeout nan", "--timeout must be a positive number of seconds, got nan"),
        ("--timeout inf", "--timeout must be a positive number of seconds, got inf"),
        ("--grace nan", "--grace must be a number of seconds, 0 or more, got nan"),
        ("-o never_set", "-o/--out never_set: the cell never assigns it nor reads it from the notebook"),
        ("\n!pip install x", "line 2 uses `!pip`: %%kinetic cells run as plain Python on the hosts; use subprocess"),
        ("--bogus", "unrecognized arguments: --bogus"),
        ("--en X=1", "unrecognized arguments: --en X=1"),  # never an abbreviation of --env
        ("-b slurm", "argument -b/--backend: invalid choice: 'slurm'"),
        ("--namespace ml", "--namespace is for -b kubernetes, and this cell runs on -b local"),
        ("--ssh-python python3", "--ssh-python is for -b ssh, -b tpu-vm, and this cell runs on -b local"),
        ("-b tpu-vm --tpu one", "-b tpu-vm needs the TPU VM and its zone: --tpu NAME --zone ZONE"),
        ("-b tpu-vm --tpu one --zone z --tpu-addresses public", "--tpu-addresses must be one of auto, internal, "
                                                               "external, got 'public'"),
        ("-n 10000", "10000 host processes are more than the local backend runs"),
        ("--procs-per-host 0", "--procs-per-host must be at least 1, got 0"),
        ("-a gpu-h100x8 --procs-per-host 3", "3 processes per host do not divide the 8 GPUs of a gpu-h100x8 host"),
        ("-a tpu-v5e-16 --procs-per-host 4", "4 processes per host: tpu-v5e-16 hosts run one process each"),
        ("-n 2000 --procs-per-host 8", "16000 host processes are more than the local backend runs"),
        ("--storage s3://bucket/x", "unsupported storage URI 's3://bucket/x'"),
    ],
)
def test_bad_input_is_one_usage_error_line(shell, capsys, line, expected):
    result = run_cell(shell, f"%%kinetic {line}\n1\n")
    captured = capsys.readouterr()
    assert type(result.error_in_exec).__name__ == "UsageError"
    message = str(result.error_in_exec)
    assert expected in message
    assert "\n" not in message.strip()
    assert "Traceback" not in captured.out + captured.err


def test_kinetic_accelerators_lists_every_name_with_keras_kinetics_spelling(shell, capsys):
    result = run_cell(shell, "%kinetic accelerators")
    assert result.error_in_exec is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "hosts", "x", "chips", "topology", "machine", "type", "keras-kinetic"]
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert set(rows) == set(accelerator_names())
    assert rows["tpu-v6e-2x4"][1:] == ["2", "x", "4", "2x4", "ct6e-standard-4t", "tpu:v6e-8"]
    assert rows["tpu-v5p-16"][-1] == "tpu:v5p-8"  # keras-kinetic counts chips
    assert "refused" in lines[-1]
    result = run_cell(shell, "%%kinetic -a v5p-8\n1\n")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert str(result.error_in_exec).startswith("accelerator 'v5p-8' is two slices: ")


def test_help_lists_the_flags(shell):
    doc = shell.find_cell_magic("kinetic").__doc__
    assert doc.split()[1] == "%%kinetic"  # its usage as it is typed, not the method's name (%kinetic_cell)
    for flag in ("--hosts", "--accelerator", "--backend", "--framework", "--out", "--env", "--timeout", "--storage",
                 "--quiet"):
        assert flag in doc
    # Each backend's own flags, grouped under its name: the magic hard-codes none of them.
    kubernetes = doc.split("-b kubernetes:")[1]
    assert "--namespace NS" in kubernetes and "--image IMAGE" in kubernetes
    assert "--service-account NAME" in kubernetes


def test_the_pods_service_account_comes_from_the_flag_else_the_environment_else_config(shell, monkeypatch):
    from IPython.core.magic_arguments import parse_argstring

    from kinetic_nb.backends.kubernetes.backend import KubernetesBackend

    magics = shell.magics_manager.registry["KineticMagics"]
    cell = shell.find_cell_magic("kinetic").__func__

    def service_account(line: str) -> str | None:
        options = magics._backend_options(parse_argstring(cell, line))
        return KubernetesBackend.from_options(**options).settings.service_account

    monkeypatch.delenv("KINETIC_SERVICE_ACCOUNT", raising=False)
    monkeypatch.setattr(magics, "service_account", None)
    assert service_account("-b kubernetes") is None
    shell.run_line_magic("config", "KineticMagics.service_account = 'from-config'")
    assert service_account("-b kubernetes") == "from-config"
    monkeypatch.setenv("KINETIC_SERVICE_ACCOUNT", "from-env")
    assert service_account("-b kubernetes") == "from-env"
    assert service_account("-b kubernetes --service-account from-flag") == "from-flag"


def test_the_pending_limit_comes_from_the_flag_else_the_environment_else_config(shell, monkeypatch):
    from IPython.core.magic_arguments import parse_argstring

    from kinetic_nb.backends.kubernetes.backend import KubernetesBackend

    magics = shell.magics_manager.registry["KineticMagics"]
    cell = shell.find_cell_magic("kinetic").__func__

    def pending_limit(line: str) -> float:
        options = magics._backend_options(parse_argstring(cell, line))
        return KubernetesBackend.from_options(**options).settings.pending_timeout_s

    monkeypatch.delenv("KINETIC_PENDING_TIMEOUT", raising=False)
    monkeypatch.setattr(magics, "pending_timeout_s", None)
    assert pending_limit("-b kubernetes") == 45 * 60
    shell.run_line_magic("config", "KineticMagics.pending_timeout_s = 3600")
    assert pending_limit("-b kubernetes") == 3600
    monkeypatch.setenv("KINETIC_PENDING_TIMEOUT", "1800")
    assert pending_limit("-b kubernetes") == 1800
    assert pending_limit("-b kubernetes --pending-timeout 900") == 900


def test_a_registered_backend_brings_its_flags(monkeypatch):
    from IPython.core.magic_arguments import magic_arguments

    from kinetic_nb.backends import base
    from kinetic_nb.backends.testing import register_fake
    from kinetic_nb.notebook.magics import _backend_flags

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # registered for this test only
    register_fake()

    @magic_arguments()
    @_backend_flags
    def cell(line, cell):
        """A magic."""

    assert "-b fake:" in cell.__doc__ and "--fake-scenario NAME" in cell.__doc__
    assert cell.__doc__.index("-b local:") < cell.__doc__.index("-b kubernetes:")  # in registration order
    assert cell.__doc__.index("-b kubernetes:") < cell.__doc__.index("-b fake:")


def test_syntax_error_names_the_cell_line(shell):
    result = run_cell(shell, "%%kinetic -n 2\nx = 1\ny = = 2\n")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert "line 3" in str(result.error_in_exec)  # the cell's own numbering, %%kinetic being line 1


def test_unpicklable_notebook_value_is_named_before_any_host_starts(shell, storage_root):
    run_cell(shell, "import threading\nlock = threading.Lock()")
    root = pathlib.Path(storage_root.removeprefix("file://"))
    stored_before, last_before = sorted(root.rglob("*")), kinetic_nb.last_job()
    result = run_cell(shell, "%%kinetic -n 2\nlock\n")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert str(result.error_in_exec).startswith("cannot ship variable 'lock' (a _thread.lock) to the hosts"), result.error_in_exec
    # Nothing was stored, no job was submitted: no host could have started.
    assert sorted(root.rglob("*")) == stored_before and kinetic_nb.last_job() is last_before


def test_value_becomes_out_and_out_variables_land(shell):
    run_cell(shell, "base = 5\ndef triple(x):\n    return 3 * x\n")
    result = run_cell(shell, "%%kinetic -n 2 -o made,also\nimport os\nmade = triple(base)\nalso = os.environ['RANK']\nmade + 1\n")
    assert result.error_in_exec is None, result.error_in_exec
    assert result.result == 16
    assert shell.user_ns["made"] == 15
    assert shell.user_ns["also"] == "0"  # the leader's variables, not a worker's
    assert shell.user_ns["Out"][result.execution_count] == 16


def test_remote_exception_is_raised_in_the_shell(shell):
    result = run_cell(shell, "%%kinetic -n 2\nimport os\nif os.environ['RANK'] == '1':\n    raise ValueError('nope')\n")
    assert isinstance(result.error_in_exec, ValueError)
    coloured = "\n".join(result.error_in_exec._render_traceback_())
    rendered = re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    # As IPython draws a local one: the exception over the traceback, the cell as In[n], the arrow on the line.
    assert re.search(r"^ValueError +Traceback from host 1 \(most recent call last\)$", rendered, re.M)
    assert re.search(r"^Cell In\[\d+\], line 4\n----> 4 raise ValueError\('nope'\)$", rendered, re.M)
    assert "\x1b[31m\x1b[1mValueError\x1b[0m: nope" in coloured
    assert rendered.splitlines()[-1].startswith("Reported by host 1")


def test_env_values_are_masked_in_every_spelling_the_parser_takes():
    from IPython.core.magic_arguments import MagicArgumentParser

    from kinetic_nb.notebook.magics import refuse_abbreviations, without_env_values

    parser = refuse_abbreviations(MagicArgumentParser(prog="%test", add_help=False))
    parser.add_argument("-q", action="store_true")
    parser.add_argument("-e", "--env", action="append", default=[])
    line = "-qeA=sec-1 -q -e B=sec-2 -eC=sec-3 --env=D=sec-4 --env E=sec-5 -e=F=sec-6 -qe G=sec-7"
    masked = without_env_values(line, parser)
    assert "sec-" not in masked
    assert sorted(parser.parse_argstring(masked).env) == [f"{name}=***" for name in "ABCDEFG"]


def test_a_cell_on_local_by_default_while_ssh_hosts_are_named_says_so(shell, capsys, monkeypatch):
    """With $KINETIC_SSH_HOSTS set and no -b, the cell still runs here (nothing chose ssh), and says where it ran
    and how to run there; once a default is chosen, it says nothing."""
    monkeypatch.setenv("KINETIC_SSH_HOSTS", "worker-0,worker-1")
    monkeypatch.delenv("KINETIC_BACKEND", raising=False)
    result = run_cell(shell, "%%kinetic -n 2 --quiet\n6 * 7\n")
    assert result.error_in_exec is None and result.result == 42
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kinetic_nb: this cell")]
    assert notices == ["kinetic_nb: this cell runs here (-b local); $KINETIC_SSH_HOSTS names hosts of -b ssh: add "
                       "-b ssh, or make it the default with %config KineticMagics.backend = 'ssh' "
                       "(or $KINETIC_BACKEND=ssh)"]
    run_cell(shell, "%config KineticMagics.backend = 'local'")
    try:
        assert run_cell(shell, "%%kinetic -n 2 --quiet\n6 * 7\n").result == 42
        assert "kinetic_nb: this cell" not in capsys.readouterr().out
    finally:
        run_cell(shell, "%config KineticMagics.backend = None")


def test_the_default_backend_comes_from_config_then_the_environment(shell, capsys, monkeypatch):
    """$KINETIC_BACKEND=ssh makes a cell with no -b an ssh cell (here its host cannot be reached: one line from
    the ssh backend); a name that is no backend is one line naming where it came from."""
    monkeypatch.setenv("KINETIC_BACKEND", "ssh")
    monkeypatch.setenv("KINETIC_SSH_HOSTS", "no-such-host.invalid")
    result = run_cell(shell, "%%kinetic --quiet\n1\n")
    assert type(result.error_in_exec).__name__ == "SshHostError"  # it went to ssh: its host, in one line
    assert str(result.error_in_exec).startswith("host 0 (no-such-host.invalid) cannot be reached")
    monkeypatch.setenv("KINETIC_BACKEND", "slurm")
    result = run_cell(shell, "%%kinetic --quiet\n1\n")
    assert type(result.error_in_exec).__name__ == "UsageError"
    assert str(result.error_in_exec) == ("$KINETIC_BACKEND names no backend: 'slurm'; one of local, kubernetes, "
                                         "ray, ssh, tpu-vm")
    run_cell(shell, "%config KineticMagics.backend = 'slurm'")
    try:
        result = run_cell(shell, "%%kinetic --quiet\n1\n")
        assert str(result.error_in_exec).startswith("%config KineticMagics.backend names no backend: 'slurm'")
    finally:
        run_cell(shell, "%config KineticMagics.backend = None")
    capsys.readouterr()


def test_a_cell_whose_bucket_does_not_answer_is_one_line_in_the_users_words(shell, capsys, monkeypatch):
    """No storage object's name in what the notebook shows (#39): what could not be stored, where, and why."""
    from .gcs_emulator import free_port

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("KINETIC_GCS_RETRY_S", "0.5")
    result = run_cell(shell, "%%kinetic -n 2 --storage gs://kinetic-tests/gone\n1 + 1\n")
    shown = capsys.readouterr().out.strip()
    assert type(result.error_in_exec).__name__ == "StorageError"
    assert re.fullmatch(r"StorageError: cannot store the cell's code in gs://kinetic-tests/gone/kn-[\w-]+: its "
                        r"storage has not answered for [\d.]+ s \(an outage is ridden out for 0\.5 s\): Connection "
                        r"refused", shown), shown
    assert not re.search(r"\.(json|pkl)\b|HTTPConnectionPool|urllib3", shown)
