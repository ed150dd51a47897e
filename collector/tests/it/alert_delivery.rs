//! Alert delivery across `kill -9`: the real binary, a webhook receiver that can be made to
//! fail, and a collector that never flushes (so alert states live only in the journal). A
//! receiver hears each alert firing once and its resolution once, whatever the crashes; a
//! resolution it missed reaches it after the restart; an alert whose run never reports again
//! does not stay firing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rankwatch_analytics::simulate::{DataParallelSim, Fault};
use serde_json::Value;

use crate::alerting::step_rows;
use crate::common::*;

const WORLD: u32 = 4;

/// The webhook (`/hook`) and Slack (`/slack`) receivers, one stub.
struct Hooks {
    url: String,
    slack: String,
    got: Arc<Mutex<Vec<(String, Value)>>>,
    down: Arc<AtomicBool>,
}

impl Hooks {
    fn start() -> Hooks {
        let stub = Receiver::start(0);
        Hooks {
            url: format!("{}/hook", stub.base),
            slack: format!("{}/slack", stub.base),
            got: stub.got,
            down: stub.down,
        }
    }

    /// (event, incident id) of every accepted webhook delivery.
    fn heard(&self) -> Vec<(String, String)> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|(path, _)| path == "/hook")
            .map(|(_, b)| {
                (
                    b["event"].as_str().unwrap_or("").to_owned(),
                    b["incident"]["id"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect()
    }

    /// The event word (`opened`, `resolved`) of every accepted Slack message, in order.
    fn slack_heard(&self) -> Vec<String> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|(path, _)| path == "/slack")
            .map(|(_, b)| {
                let text = b["text"].as_str().unwrap_or("");
                let state = text.split('[').nth(1).and_then(|t| t.split(']').next());
                state.unwrap_or("").to_owned()
            })
            .collect()
    }

    /// Waits until the webhook heard what `done` wants, and Slack (its own thread) as many
    /// messages.
    fn wait_for(&self, what: &str, done: impl Fn(&[(String, String)]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done(&self.heard()) || self.slack_heard().len() < self.heard().len() {
            assert!(
                Instant::now() < deadline,
                "{what}; heard {:?}",
                self.heard()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Binary {
    /// SIGKILL (also when a test fails, so that no collector outlives it).
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The collector binary; never flushes on its own, so alerts live in the journal only.
struct Binary {
    child: Child,
    base: String,
    dir: std::path::PathBuf,
}

impl Binary {
    fn start(dir: &std::path::Path, hook: &Hooks, extra: &[&str]) -> Binary {
        let mut args = vec!["--flush-interval", "1h", "--alert-max-attempts", "1"];
        args.extend([
            "--webhook-url",
            &hook.url,
            "--slack-webhook-url",
            &hook.slack,
        ]);
        args.extend(extra);
        let (child, base) = spawn_rankwatch(dir, &args);
        Binary {
            child,
            base,
            dir: dir.to_owned(),
        }
    }

    /// Waits until both receivers' records (`DIR/alert-delivery/`) name alert `id`: delivery
    /// is at least once, and a kill between a receiver's acceptance and the record's write
    /// would tell it again; the tests kill after that point.
    fn wait_recorded(&self, id: &str) {
        let records = self.dir.join("alert-delivery");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let naming = std::fs::read_dir(&records)
                .map(|entries| {
                    // Written records only: a `.tmp` not yet renamed is not one.
                    entries
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|p| p.extension().is_some_and(|x| x == "json"))
                        .filter_map(|p| std::fs::read_to_string(p).ok())
                        .filter(|text| text.contains(id))
                        .count()
                })
                .unwrap_or(0);
            if naming >= 2 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the deliveries of {id} were never recorded"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill9(self) {
        drop(self);
    }

    fn post(&self, path: &str, key: Option<&str>, body: Vec<u8>) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut request = agent
            .post(format!("{}{path}", self.base))
            .header("content-type", ARROW);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let mut response = request.send(&body[..]).unwrap();
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap_or_default();
        assert_eq!(status, 200, "{text}");
    }

    fn metrics(&self) -> String {
        ureq::get(format!("{}/metrics", self.base))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap()
    }

    fn alerts(&self, run: &str) -> Vec<Value> {
        let text = ureq::get(format!("{}/api/v1/alerts?run={run}", self.base))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        serde_json::from_str::<Value>(&text).unwrap()["alerts"]
            .as_array()
            .unwrap()
            .clone()
    }

    fn wait_alert(&self, run: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(a) = self.alerts(run).into_iter().find(|a| pred(a)) {
                return a;
            }
            assert!(Instant::now() < deadline, "{what}: {:#?}", self.alerts(run));
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Steps `steps` of a 4-rank run; rank 1's loss is NaN at `nan_at`.
    fn steps(
        &self,
        run: &str,
        sim: &mut DataParallelSim,
        steps: std::ops::Range<u64>,
        nan_at: u64,
    ) {
        for step in steps {
            let mut obs = sim.step(step, Fault::None);
            if step == nan_at {
                obs.ranks[1].loss = Some(f64::NAN);
            }
            let key = format!("{run}/0/t/{step}");
            self.post(
                "/api/v1/ingest",
                Some(&key),
                samples_ipc(&step_rows(run, &obs), false),
            );
        }
    }
}

impl Binary {
    /// Announces a 4-rank `run`, sends steps 0..12 with a NaN on rank 1 at step 7, and waits
    /// until its alert fires and the webhook heard its incident open; returns the alert's id.
    fn fire_nan(&self, run: &str, sim: &mut DataParallelSim, hook: &Hooks) -> String {
        self.post(
            "/api/v1/ingest?table=runs",
            None,
            runs_ipc(&info(run, WORLD, 2)),
        );
        self.steps(run, sim, 0..12, 7);
        let fired = self.wait_alert(run, "the NaN fires", |a| {
            is_nan_alert(a) && a["state"] == "firing"
        });
        let id = fired["id"].as_str().unwrap().to_owned();
        hook.wait_for("the incident's opening is delivered", |h| {
            h.contains(&("opened".into(), incident(&id)))
        });
        self.wait_recorded(&id);
        id
    }
}

/// The id of the incident whose cause is alert `id`.
fn incident(id: &str) -> String {
    format!("incident:{id}")
}

fn is_nan_alert(a: &Value) -> bool {
    a["rule"] == "nonfinite" && a["rank"] == 1
}

#[test]
fn a_receiver_hears_each_alert_once_across_kill_9_and_a_missed_resolution_after_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let hook = Hooks::start();
    let run = "deliver";
    let collector = Binary::start(dir.path(), &hook, &[]);
    let mut sim = DataParallelSim::new(WORLD, 64, 3);
    let id = collector.fire_nan(run, &mut sim, &hook);

    // kill -9 before any flush: the log replays, the detector raises the alert again.
    collector.kill9();
    let collector = Binary::start(dir.path(), &hook, &[]);
    let restored = collector.wait_alert(run, "the alert is restored", |a| a["id"] == id.as_str());
    assert_eq!(restored["state"], "firing");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        hook.heard(),
        [("opened".to_owned(), incident(&id))],
        "not told twice"
    );

    // The resolution happens while the receiver is down (one attempt, failed), then the
    // collector dies before anything is flushed.
    hook.down.store(true, Ordering::SeqCst);
    collector.steps(run, &mut sim, 12..40, u64::MAX);
    collector.wait_alert(run, "the alert resolves", |a| {
        a["id"] == id.as_str() && a["state"] == "resolved"
    });
    std::thread::sleep(Duration::from_millis(500));
    collector.kill9();

    // Back up: the resolution is still known (the journal), and the receiver gets it now.
    hook.down.store(false, Ordering::SeqCst);
    let collector = Binary::start(dir.path(), &hook, &[]);
    let after = collector.wait_alert(run, "the resolution survives kill -9", |a| {
        a["id"] == id.as_str()
    });
    assert_eq!(after["state"], "resolved", "{after:#}");
    hook.wait_for("the missed resolution is delivered", |h| {
        h.contains(&("resolved".into(), incident(&id)))
    });
    // The replay fed the detectors the NaN again and they raised the alert again, firing then
    // resolved: an echo of what the journal holds, counted and dropped. (Before, it was raised
    // anew, and a receiver whose missed resolution went out first heard it fire again.)
    let deadline = Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let metrics = collector.metrics();
        if metrics.contains("rankwatch_alert_replay_echoes_total 2") {
            break metrics;
        }
        assert!(
            Instant::now() < deadline,
            "no replay echo counted:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        !metrics.contains("rankwatch_alert_transitions_total{rule=\"nonfinite\""),
        "the replay raised the resolved alert again:\n{metrics}"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        hook.heard(),
        [
            ("opened".to_owned(), incident(&id)),
            ("resolved".to_owned(), incident(&id))
        ],
        "each state once"
    );
    collector.kill9();
}

/// A real Alertmanager (Debian's `prometheus-alertmanager`, which `cargo xtask test`
/// installs) on a free port; `None` where it is not installed.
struct Alertmanager {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Alertmanager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Alertmanager {
    fn start() -> Option<Alertmanager> {
        Alertmanager::start_with("route:\n  receiver: devnull\nreceivers:\n  - name: devnull\n")
    }

    /// One that groups by incident, as `deploy/alertmanager/alertmanager.yml` does, and
    /// notifies the webhook `url` within a second.
    fn notifying(url: &str) -> Option<Alertmanager> {
        Alertmanager::start_with(&format!(
            "route:\n  receiver: hook\n  group_by: [incident]\n  group_wait: 1s\n  \
             group_interval: 1s\n  repeat_interval: 1h\nreceivers:\n  - name: hook\n    \
             webhook_configs:\n      - url: {url}\n        send_resolved: true\n"
        ))
    }

    fn start_with(config_text: &str) -> Option<Alertmanager> {
        let binary = [
            "/usr/bin/prometheus-alertmanager",
            "/usr/local/bin/alertmanager",
        ]
        .into_iter()
        .find(|b| std::path::Path::new(b).exists())?;
        let dir = tempfile::tempdir().unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("alertmanager.yml");
        std::fs::write(&config, config_text).unwrap();
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--cluster.listen-address=")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let url = format!("http://127.0.0.1:{port}");
        let am = Alertmanager {
            child,
            url,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while ureq::get(format!("{}/-/ready", am.url)).call().is_err() {
            assert!(Instant::now() < deadline, "alertmanager did not start");
            std::thread::sleep(Duration::from_millis(200));
        }
        Some(am)
    }

    /// The `state` of each alert Alertmanager holds for `run` (`active`, or `unprocessed`
    /// just after a post; a resolved one drops out of the default listing).
    fn states(&self, run: &str) -> Vec<String> {
        let text = ureq::get(format!("{}/api/v2/alerts", self.url))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        serde_json::from_str::<Vec<Value>>(&text)
            .unwrap()
            .iter()
            .filter(|a| a["labels"]["run"] == run)
            .map(|a| a["status"]["state"].as_str().unwrap_or("").to_owned())
            .collect()
    }

    fn wait_for(&self, run: &str, what: &str, done: impl Fn(&[String]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done(&self.states(run)) {
            assert!(Instant::now() < deadline, "{what}: {:?}", self.states(run));
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

#[test]
fn an_alert_whose_run_never_reports_again_resolves_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let hook = Hooks::start();
    let am = Alertmanager::start();
    if am.is_none() {
        eprintln!(
            "prometheus-alertmanager is not installed: only the webhook and Slack are checked"
        );
    }
    let mut extra = vec!["--alertmanager-resend", "1s"];
    let am_url = am.as_ref().map(|a| a.url.clone()).unwrap_or_default();
    if am.is_some() {
        extra.extend(["--alertmanager-url", am_url.as_str()]);
    }
    let run = "abandoned";
    let collector = Binary::start(dir.path(), &hook, &extra);
    let mut sim = DataParallelSim::new(WORLD, 64, 3);
    let id = collector.fire_nan(run, &mut sim, &hook);
    if let Some(am) = &am {
        am.wait_for(run, "Alertmanager holds the firing alert", |s| {
            s.iter().any(|x| x == "active")
        });
    }
    collector.kill9();

    // The run never reports again; after --idle-evict the alert is resolved and said so, to
    // every receiver (Alertmanager would otherwise keep it until its own resolve_timeout).
    extra.extend(["--idle-evict", "2s"]);
    let collector = Binary::start(dir.path(), &hook, &extra);
    let resolved = collector.wait_alert(run, "the abandoned alert resolves", |a| {
        a["id"] == id.as_str() && a["state"] == "resolved"
    });
    assert!(
        resolved["explanation"]
            .as_str()
            .unwrap()
            .contains("the run stopped reporting"),
        "{resolved:#}"
    );
    hook.wait_for("the resolution is delivered", |h| {
        h.contains(&("resolved".into(), incident(&id)))
    });
    assert_eq!(
        hook.heard(),
        [
            ("opened".to_owned(), incident(&id)),
            ("resolved".to_owned(), incident(&id))
        ],
        "each state once"
    );
    assert_eq!(hook.slack_heard(), ["opened", "resolved"]);
    if let Some(am) = &am {
        am.wait_for(run, "Alertmanager has the resolution", |s| {
            s.iter().all(|x| x != "active")
        });
    }
    collector.kill9();
}

/// Alertmanager gets every alert labelled with its incident, so that its own grouping
/// (`group_by: [incident]`) notifies per incident: a NaN on every rank (4 alerts) is one group,
/// a second NaN 200 steps later another.
#[test]
fn alertmanager_groups_by_the_incident_label_one_group_per_incident() {
    let notified = Receiver::start(0);
    let Some(am) = Alertmanager::notifying(&format!("{}/am", notified.base)) else {
        eprintln!("prometheus-alertmanager is not installed: skipped");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let hook = Hooks::start();
    let collector = Binary::start(
        dir.path(),
        &hook,
        &["--alertmanager-url", &am.url, "--alertmanager-resend", "1s"],
    );
    let run = "grouped";
    collector.post(
        "/api/v1/ingest?table=runs",
        None,
        runs_ipc(&info(run, WORLD, 2)),
    );
    let mut sim = DataParallelSim::new(WORLD, 64, 3);
    for step in 0..230u64 {
        let mut obs = sim.step(step, Fault::None);
        for (rank, r) in obs.ranks.iter_mut().enumerate() {
            if step == 7 || (step == 200 && rank == 2) {
                r.loss = Some(f64::NAN);
            }
        }
        collector.post(
            "/api/v1/ingest",
            Some(&format!("{run}/0/t/{step}")),
            samples_ipc(&step_rows(run, &obs), false),
        );
    }
    let alerts = collector.alerts(run);
    let nan: Vec<&Value> = alerts.iter().filter(|a| a["rule"] == "nonfinite").collect();
    assert_eq!(nan.len(), 5, "{alerts:#?}");
    // What Alertmanager sent its receiver: each group's incident label and the ranks of the
    // alerts its notifications held. (The simulated run's clock starts in 1970, so Alertmanager
    // sends a group at once rather than after group_wait: an alert's first notification may
    // precede its siblings'; which group each lands in is what this checks.)
    let groups = || -> BTreeMap<String, BTreeSet<String>> {
        let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (path, body) in notified.got.lock().unwrap().iter() {
            if path != "/am" {
                continue;
            }
            let incident = body["groupLabels"]["incident"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            let ranks = out.entry(incident).or_default();
            for a in body["alerts"].as_array().unwrap() {
                ranks.insert(a["labels"]["rank"].as_str().unwrap_or("").to_owned());
            }
        }
        out
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while groups().len() < 2 {
        assert!(Instant::now() < deadline, "notified: {:?}", groups());
        std::thread::sleep(Duration::from_millis(200));
    }
    let first: Vec<&&Value> = nan.iter().filter(|a| a["first_step"] == 7).collect();
    let second: Vec<&&Value> = nan.iter().filter(|a| a["first_step"] == 200).collect();
    assert_eq!((first.len(), second.len()), (4, 1));
    let incidents = collector_incidents(&collector, run);
    let id_of = |alert: &Value| {
        incidents
            .iter()
            .find(|i| {
                i["alerts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|a| a["id"] == alert["id"])
            })
            .map(|i| i["id"].as_str().unwrap().to_owned())
            .unwrap()
    };
    let ranks = |list: &[&str]| {
        list.iter()
            .map(|r| (*r).to_owned())
            .collect::<BTreeSet<_>>()
    };
    let expected: BTreeMap<String, BTreeSet<String>> = [
        (id_of(first[0]), ranks(&["0", "1", "2", "3"])),
        (id_of(second[0]), ranks(&["2"])),
    ]
    .into_iter()
    .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while groups() != expected {
        assert!(
            Instant::now() < deadline,
            "one group per incident, holding its alerts: {:?}",
            groups()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    collector.kill9();
}

/// `GET /api/v1/incidents?run=` of the real binary.
fn collector_incidents(collector: &Binary, run: &str) -> Vec<Value> {
    let text = ureq::get(format!("{}/api/v1/incidents?run={run}", collector.base))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    serde_json::from_str::<Value>(&text).unwrap()["incidents"]
        .as_array()
        .unwrap()
        .clone()
}

/// `rankwatch serve --help` documents the variables it reads but never prints their values:
/// tokens, and webhook, Slack and Alertmanager URLs (a webhook URL's path is its secret, an
/// Alertmanager URL may carry credentials). Before, the webhook and Alertmanager URLs were
/// printed.
#[test]
fn help_never_prints_the_secrets_it_reads_from_the_environment() {
    let secrets = [
        ("RANKWATCH_INGEST_TOKEN", "in-secret-1"),
        ("RANKWATCH_READ_TOKEN", "read-secret-2"),
        ("RANKWATCH_ADMIN_TOKEN", "admin-secret-3"),
        (
            "RANKWATCH_WEBHOOK_URLS",
            "https://hooks.example/hook-secret-4",
        ),
        (
            "RANKWATCH_SLACK_WEBHOOK_URLS",
            "https://hooks.slack.com/services/secret-5",
        ),
        (
            "RANKWATCH_ALERTMANAGER_URLS",
            "https://user:pass-secret-6@am.example",
        ),
    ];
    let out = Command::new(env!("CARGO_BIN_EXE_rankwatch"))
        .args(["serve", "--help"])
        .envs(secrets)
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for (name, value) in secrets {
        assert!(help.contains(name), "{name} is documented");
        assert!(!help.contains(value), "{name}'s value is printed:\n{help}");
    }
}

/// Issue 45 item 10: a webhook's or Slack's URL carries its secret in its path, query or user
/// info, and Alertmanager's in its user info. Deliveries that fail are logged (the logging
/// path, not `--help`): the lines name the receiver's origin only, never a secret.
#[test]
fn failed_deliveries_are_logged_without_the_receivers_secrets() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    // A port nobody listens on: every delivery fails and is logged.
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let hook = format!("http://127.0.0.1:{closed}/hooks/wh-secret-1?token=wh-secret-2");
    let slack = format!("http://bot:sl-secret-3@127.0.0.1:{closed}/services/T0/B0/sl-secret-4");
    let am = format!("http://am:am-secret-5@127.0.0.1:{closed}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rankwatch"))
        .args(["serve", "--listen", "127.0.0.1:0", "--flush-interval", "1h"])
        .args(["--alert-max-attempts", "1"])
        .args(["--webhook-url", &hook, "--slack-webhook-url", &slack])
        .args(["--alertmanager-url", &am])
        .arg("--data-dir")
        .arg(dir.path())
        .env("RANKWATCH_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line.trim().rsplit(' ').next().unwrap().to_owned();
    let log = Arc::new(Mutex::new(String::new()));
    let stderr = child.stderr.take().unwrap();
    let collected = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            collected.lock().unwrap().push_str(&line);
            collected.lock().unwrap().push('\n');
        }
    });
    let collector = Binary {
        child,
        base,
        dir: dir.path().to_owned(),
    };
    let run = "secrets";
    collector.post(
        "/api/v1/ingest?table=runs",
        None,
        runs_ipc(&info(run, WORLD, 2)),
    );
    let mut sim = DataParallelSim::new(WORLD, 64, 3);
    collector.steps(run, &mut sim, 0..12, 7);
    let deadline = Instant::now() + Duration::from_secs(30);
    while log.lock().unwrap().matches("giving up").count() < 3 {
        assert!(
            Instant::now() < deadline,
            "three receivers' failures were never logged:\n{}",
            log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(collector);
    let log = log.lock().unwrap().clone();
    for secret in ["secret-1", "secret-2", "secret-3", "secret-4", "secret-5"] {
        assert!(!log.contains(secret), "{secret} is in the log:\n{log}");
    }
    assert!(
        log.contains(&format!("http://127.0.0.1:{closed}/…")),
        "the origin is named:\n{log}"
    );
}
