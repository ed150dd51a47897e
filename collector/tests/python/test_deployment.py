"""The compose deployment, tested without a Docker engine (there is none on this machine):

- docker-compose.yml parses; every file it mounts exists; the services reach each other on the
  ports they listen on; the collector accepts the compose file's command and environment;
- Prometheus's configuration and rules pass `promtool`, Alertmanager's passes `amtool`;
- Grafana's provisioning points at the mounted dashboards and a datasource they use;
- every PromQL expression of every dashboard returns data from a real Prometheus (Debian's)
  scraping a collector fed by a real 2-rank PyTorch run with a fault, which posts its alerts
  to a real Alertmanager.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from conftest import Collector, free_port

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
EXAMPLE = ROOT / "sdk-python" / "examples" / "train_ddp.py"


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def bind_mounts(service: dict) -> list[tuple[Path, str]]:
    out = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out.append(((ROOT / source).resolve(), target))
    return out


def exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_compose_file_references_existing_files_and_consistent_ports() -> None:
    c = compose()
    services = c["services"]
    assert set(services) == {"tokens", "collector", "prometheus", "alertmanager", "grafana"}
    # Every bind-mounted file exists; named volumes are declared.
    for name, service in services.items():
        for source, _ in bind_mounts(service):
            assert source.exists(), f"{name} mounts {source}, which does not exist"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith("."):
                assert source in c["volumes"], f"{name} uses undeclared volume {source}"
    # The collector image is built from this repository's Dockerfile with the release command
    # (`cargo xtask dist --collector`: the dashboard, then the release binary of the archive),
    # and the image's binary is the one that command puts in target/dist/bin.
    assert services["collector"]["build"] == "."
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "cargo xtask dist --collector" in dockerfile and "target/dist/bin/rankwatch" in dockerfile
    xtask_dist = (ROOT / "xtask/src/dist.rs").read_text()
    assert '"--collector" => options.collector_only = true' in xtask_dist and 'out.join("bin/rankwatch")' in xtask_dist
    assert (ROOT / ".dockerignore").read_text().splitlines()[0] == "target"
    # Ports: each service's published container port is the one the others are told.
    listen = services["collector"]["environment"]["RANKWATCH_LISTEN"]
    collector_port = listen.rsplit(":", 1)[1]
    assert services["collector"]["ports"] == [f"127.0.0.1:{collector_port}:{collector_port}"]
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    scrape = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert scrape == [f"collector:{collector_port}"]
    am = prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["alertmanager:9093"] and services["alertmanager"]["ports"] == ["127.0.0.1:9093:9093"]
    assert "--alertmanager-url=http://alertmanager:9093" in services["collector"]["command"]
    # Secure by default: the tokens service makes the tokens in a volume the collector reads
    # them from (it waits for it), Prometheus scrapes with the read token from the same
    # volume, nothing turns the guard off, and the name Prometheus uses is an allowed host.
    tokens = services["tokens"]
    assert tokens["command"][0] == "tokens" and "--shared" in tokens["command"]
    token_dir = tokens["command"][tokens["command"].index("--dir") + 1]
    volume = next(v.split(":")[0] for v in tokens["volumes"] if v.split(":")[1] == token_dir)
    collector = services["collector"]
    assert collector["depends_on"]["tokens"]["condition"] == "service_completed_successfully"
    assert f"{volume}:{token_dir}:ro" in collector["volumes"] and f"{volume}:{token_dir}:ro" in services["prometheus"]["volumes"]
    for group in ("INGEST", "READ", "ADMIN"):
        assert collector["environment"][f"RANKWATCH_{group}_TOKEN_FILE"] == f"{token_dir}/{group.lower()}-token"
    assert "RANKWATCH_INSECURE" not in collector["environment"]
    assert "--allowed-host=collector" in collector["command"] and scrape == ["collector:7070"]
    credentials = prometheus["scrape_configs"][0]["authorization"]
    assert credentials == {"type": "Bearer", "credentials_file": f"{token_dir}/read-token"}
    # Prometheus loads the rule file it is given.
    mounts = dict((t, s) for s, t in bind_mounts(services["prometheus"]))
    for rule_file in prometheus["rule_files"]:
        assert rule_file in mounts, f"{rule_file} is not mounted into prometheus"
    # Grafana: the datasource points at the prometheus service; the dashboard provider reads
    # the directory ./dashboards is mounted on; every panel uses the provisioned datasource.
    grafana = {t: s for s, t in bind_mounts(services["grafana"])}
    provisioning = grafana["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    provider = yaml.safe_load((provisioning / "dashboards/rankwatch.yml").read_text())["providers"][0]
    assert grafana[provider["options"]["path"]] == (ROOT / "dashboards").resolve()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent.as_posix() == provider["options"]["path"] and (ROOT / "dashboards" / Path(home).name).exists()
    assert len(DASHBOARDS) >= 2
    uids = set()
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        uids.add(d["uid"])
        for panel in d["panels"]:
            assert panel["datasource"]["uid"] == datasource["uid"], (path.name, panel["title"])
            assert panel["targets"], (path.name, panel["title"])
    assert len(uids) == len(DASHBOARDS), "dashboard uids must be unique"


def test_prometheus_and_alertmanager_configs_pass_their_own_checkers(tmp_path: Path) -> None:
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    amtool = shutil.which("amtool") or "/usr/bin/amtool"
    rules = ROOT / "deploy/prometheus/alerts.yml"
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    # The config names the rule file and the token file by their paths inside the container;
    # check a copy that names them here instead (promtool opens the token file).
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["rule_files"] = [str(rules)]
    token = tmp_path / "read-token"
    token.write_text("0" * 64 + "\n")
    config["scrape_configs"][0]["authorization"]["credentials_file"] = str(token)
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    done = subprocess.run([promtool, "check", "config", str(local)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([promtool, "check", "config", str(ROOT / "deploy/prometheus/federation.yml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([amtool, "check-config", str(ROOT / "deploy/alertmanager/alertmanager.yml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_collector_accepts_the_compose_command_and_environment(tmp_path: Path) -> None:
    """The tokens service's command, then the collector's, as compose runs them (paths inside
    the containers mapped to a temporary directory): tokens required, a rebound name refused."""
    services = compose()["services"]
    binary = os.environ["RANKWATCH_BIN"]
    token_dir = services["tokens"]["command"][services["tokens"]["command"].index("--dir") + 1]
    here = tmp_path / "tokens"
    command = [here.as_posix() if part == token_dir else part for part in services["tokens"]["command"]]
    made = subprocess.run([binary, *command], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and "shown this once" in made.stdout, made.stdout + made.stderr
    again = subprocess.run([binary, *command], capture_output=True, text=True, timeout=60)
    assert "not shown again" in again.stdout and (here / "read-token").read_text().strip() in made.stdout, again.stdout
    read_token = (here / "read-token").read_text().strip()
    service = services["collector"]
    env = {**os.environ, "RANKWATCH_LOG": "warn"}
    for key, value in service["environment"].items():
        # ${VAR:-default} as compose expands it with nothing set.
        env[key] = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value)).replace(token_dir, here.as_posix())
    env["RANKWATCH_DATA_DIR"] = str(tmp_path / "data")
    # Not 0.0.0.0 here: the test binds loopback only, on a free port.
    env["RANKWATCH_LISTEN"] = "127.0.0.1:0"
    proc = subprocess.Popen([binary, *service["command"]], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    answers: dict[str, int] = {}
    if line.startswith("rankwatch listening on http://"):
        url = line.strip().rsplit(" ", 1)[1]
        answers["ready"] = requests.get(f"{url}/readyz", timeout=5).status_code
        answers["runs without a token"] = requests.get(f"{url}/api/v1/runs", timeout=5).status_code
        answers["runs with the read token"] = requests.get(f"{url}/api/v1/runs", headers={"authorization": f"Bearer {read_token}"}, timeout=5).status_code
        answers["the dashboard under a rebound name"] = requests.get(f"{url}/", headers={"host": "evil.example:7070"}, timeout=5).status_code
        answers["the dashboard as Prometheus's name"] = requests.get(f"{url}/healthz", headers={"host": "collector:7070"}, timeout=5).status_code
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    # Every outcome with the collector's own log, so a failure explains itself.
    log = proc.stderr.read()[-4000:] if proc.stderr else ""
    assert line.startswith("rankwatch listening on http://"), (line, log)
    assert answers == {
        "ready": 200,
        "runs without a token": 401,
        "runs with the read token": 200,
        "the dashboard under a rebound name": 403,
        "the dashboard as Prometheus's name": 200,
    }, (answers, log)
    assert code == 0, (code, log)


def substitute(expr: str, run: str) -> str:
    # The run names used here hold no regex metacharacters (PromQL has no `\-` escape).
    assert re.fullmatch(r"[A-Za-z0-9_-]+", run)
    return expr.replace("$__rate_interval", "15s").replace("$run", run)


@pytest.fixture
def alertmanager(tmp_path: Path):
    port = free_port()
    binary = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
    proc = subprocess.Popen(
        [binary, f"--config.file={ROOT / 'deploy/alertmanager/alertmanager.yml'}", f"--storage.path={tmp_path / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/-/ready", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def finite(result: list) -> bool:
    return any(v[1] not in ("NaN", "+Inf", "-Inf") for r in result for v in ([r["value"]] if "value" in r else r["values"]))


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path: Path, alertmanager: str) -> None:
    """Prometheus scrapes every second while the run trains; each expression must give a
    finite value at some point (a rate over an idle counter would give 0, a quantile NaN)."""
    # As compose runs it: tokens made by `rankwatch tokens`, the collector reading them from the
    # files, Prometheus scraping with the read token's file, the training job with the ingest one.
    tokens = tmp_path / "tokens"
    made = subprocess.run([os.environ["RANKWATCH_BIN"], "tokens", "--dir", str(tokens), "--shared"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    files = [f"--{group}-token-file={tokens / f'{group}-token'}" for group in ("ingest", "read", "admin")]
    collector = Collector(tmp_path / "data", f"--alertmanager-url={alertmanager}", "--flush-interval", "1s", *files)
    prometheus = training = None
    try:
        port = free_port()
        config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        config["scrape_configs"][0]["authorization"]["credentials_file"] = str(tokens / "read-token")
        config["global"]["scrape_interval"] = "1s"
        config["rule_files"] = [str(ROOT / "deploy/prometheus/alerts.yml")]
        config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager.removeprefix("http://")]
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{collector.port}"]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prometheus = subprocess.Popen(
            [os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # One malformed batch, so the rejects panel has a reason to show.
        ingest = {"authorization": f"Bearer {(tokens / 'ingest-token').read_text().strip()}"}
        bad = requests.post(f"{collector.url}/api/v1/ingest", data=b"{not json", headers={"content-type": "application/json", **ingest}, timeout=10)
        assert bad.status_code == 400
        # A real 2-rank run whose rank 1 hits a NaN at step 40: an alert fires (and resolves),
        # so the alert gauges, transitions and Alertmanager notifications have data.
        run = "grafana-run"
        cmd = [sys.executable, str(EXAMPLE), "--nproc", "2", "--steps", "150", "--run", run, "--collector", collector.url,
               "--spool-dir", str(tmp_path / "spool"), "--layers", "2", "--width", "32", "--seq", "32", "--batch", "4",
               "--vocab", "64", "--corpus", "256", "--cadence", "spectral=5", "--fault", "nan@40:rank=1", "--step-sleep", "0.1"]
        training = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RANKWATCH_INGEST_TOKEN": ingest["authorization"].removeprefix("Bearer ")},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

        def query(expr: str) -> list:
            r = requests.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=5)
            assert r.status_code == 200, (expr, r.text)
            return r.json()["data"]["result"]

        wanted = [(path.name, title, substitute(expr, run)) for path in DASHBOARDS for title, expr in exprs(json.loads(path.read_text()))]
        # The run variable's own query.
        wanted.append(("run-health.json", "$run", "group by (run) (rankwatch_run_step)"))
        empty = wanted
        deadline = None
        while empty:
            time.sleep(1)
            try:
                empty = [w for w in empty if not finite(query(w[2]))]
            except requests.RequestException:
                pass
            if training.poll() is not None and deadline is None:
                assert training.returncode == 0, training.stderr.read()[-4000:] if training.stderr else ""
                deadline = time.monotonic() + 30
            if deadline is not None and time.monotonic() > deadline:
                break
        assert not empty, f"dashboard queries without data: {empty}"
        runs = {r["metric"]["run"] for r in query("group by (run) (rankwatch_run_step)")}
        assert run in runs
        assert any(float(r["value"][1]) > 0 for r in query(f'rankwatch_run_loss{{run="{run}"}}'))
        states = {r["metric"]["state"] for r in query("rankwatch_alert_transitions_total")}
        assert "firing" in states, states
        # The collector delivered its alert to the real Alertmanager, which holds it.
        delivered = query('rankwatch_alert_notifications_total{sink="alertmanager",outcome="delivered"}')
        assert delivered and float(delivered[0]["value"][1]) >= 1, delivered
        # Alertmanager's own count agrees (the NaN alert resolves within seconds, so it is no
        # longer listed among the active alerts).
        received = requests.get(f"{alertmanager}/metrics", timeout=5).text
        firing = [line for line in received.splitlines() if line.startswith("alertmanager_alerts_received_total") and 'status="firing"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in firing) >= 1, firing
    finally:
        if training is not None and training.poll() is None:
            training.kill()
            training.wait()
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        collector.stop()


def test_the_daemon_bounds_glibc_malloc_unless_the_operator_set_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` starts itself again with two glibc malloc settings (the memory benchmark's RSS
    fix), in the same process; an operator's own setting is kept as it is."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("no /proc on this system")
    for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    c = Collector(tmp_path / "default")
    try:
        environ = Path(f"/proc/{c.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"MALLOC_ARENA_MAX=2" in environ
        assert b"MALLOC_MMAP_THRESHOLD_=1048576" in environ
        assert requests.get(f"{c.url}/healthz", timeout=10).status_code == 200
    finally:
        c.stop()
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    c = Collector(tmp_path / "operator")
    try:
        environ = Path(f"/proc/{c.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"MALLOC_ARENA_MAX=4" in environ
        assert not any(e.startswith(b"MALLOC_MMAP_THRESHOLD_=") for e in environ)
        assert requests.get(f"{c.url}/healthz", timeout=10).status_code == 200
    finally:
        c.stop()


def test_a_sigterm_as_soon_as_it_listens_still_shuts_down_cleanly(tmp_path: Path) -> None:
    """A supervisor may stop the collector the moment it reports listening; the signal must
    reach the graceful shutdown (exit 0, the data flushed), not kill the process. Before, the
    handlers were registered lazily, after the "listening" line."""
    for i in range(8):
        c = Collector(tmp_path / f"data{i}")
        c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(timeout=60) == 0, c.log.read_text()[-2000:]
