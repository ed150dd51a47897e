//! The command-line client of a running collector: `rankwatch runs list|delete|prune`,
//! `rankwatch attach|detach RUN` and `rankwatch export`. Each is one call to the HTTP API (the same the dashboard and scripts
//! use), so what the CLI can do is exactly what the API allows with the same token.

use std::fs::File;
use std::io::{self, BufRead, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};

use rankwatch_api::{
    ByteSize, Deleted, ErrorBody, ProbeSwitch, RetentionReport, RetentionRequest, Runs, SetProbes,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::clock::{Clock, SystemClock};
use crate::config::{ExportArgs, Remote, RunsAction};
use crate::error::{Error, Result};

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        // The API's own error answers carry the message to show.
        .http_status_as_error(false)
        .build()
        .into()
}

fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The collector's message for a non-2xx answer.
fn refusal(status: u16, body: &str) -> Error {
    let message = serde_json::from_str::<ErrorBody>(body)
        .map(|b| b.error)
        .unwrap_or_else(|_| body.trim().to_owned());
    Error::Remote(format!("the collector answered {status}: {message}"))
}

fn unreachable(url: &str, e: ureq::Error) -> Error {
    Error::Remote(format!("cannot reach the collector at {url}: {e}"))
}

/// Adds the remote's bearer token, when it has one.
fn authorized<B>(request: ureq::RequestBuilder<B>, remote: &Remote) -> ureq::RequestBuilder<B> {
    match &remote.token {
        Some(t) => request.header("authorization", format!("Bearer {t}")),
        None => request,
    }
}

/// One API call; the answer is read as the contract's type `T`.
fn call<T: DeserializeOwned>(
    remote: &Remote,
    method: &str,
    path: &str,
    body: Option<&dyn Body>,
) -> Result<T> {
    let url = format!("{}{path}", remote.url.trim_end_matches('/'));
    let agent = agent();
    let json = body.map(|b| b.to_json()).transpose()?.unwrap_or_default();
    let answer = match method {
        "GET" => authorized(agent.get(&url), remote).call(),
        "DELETE" => authorized(agent.delete(&url), remote).call(),
        "PUT" => authorized(agent.put(&url), remote)
            .header("content-type", "application/json")
            .send(json.as_bytes()),
        _ => authorized(agent.post(&url), remote)
            .header("content-type", "application/json")
            .send(json.as_bytes()),
    };
    let mut answer = answer.map_err(|e| unreachable(&remote.url, e))?;
    let status = answer.status().as_u16();
    let text = answer
        .body_mut()
        .read_to_string()
        .map_err(|e| Error::Remote(format!("reading the collector's answer: {e}")))?;
    if !(200..300).contains(&status) {
        return Err(refusal(status, &text));
    }
    serde_json::from_str(&text).map_err(|e| {
        Error::Remote(format!(
            "unreadable answer from the collector to {method} {path}: {e}"
        ))
    })
}

/// A request body: any contract type (so `call` need not be generic in it).
trait Body {
    fn to_json(&self) -> Result<String>;
}

impl<T: Serialize> Body for T {
    fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string(self)?)
    }
}

fn human_bytes(n: u64) -> String {
    let units = ["B", "kB", "MB", "GB", "TB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < units.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

fn ago(ms: Option<i64>) -> String {
    let Some(ms) = ms.filter(|m| *m > 0) else {
        return "-".into();
    };
    let s = (SystemClock.now_ms() - ms).max(0) / 1000;
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m ago", s / 60),
        3600..86_400 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86_400),
    }
}

/// `rankwatch runs ...`; prints to `out`.
pub fn runs(remote: &Remote, action: &RunsAction, out: &mut dyn Write) -> Result<()> {
    match action {
        RunsAction::List { json } => {
            let answer: Runs = call(remote, "GET", "/api/v1/runs", None)?;
            if *json {
                writeln!(out, "{}", serde_json::to_string_pretty(&answer)?)?;
                return Ok(());
            }
            let runs = answer.runs;
            writeln!(
                out,
                "{:<32} {:>6} {:>10} {:>12} {:>10} {:>7} {:>9}",
                "RUN", "RANKS", "LAST STEP", "LAST SEEN", "SIZE", "FIRING", "AGENT"
            )?;
            for r in &runs {
                let num = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
                writeln!(
                    out,
                    "{:<32} {:>6} {:>10} {:>12} {:>10} {:>7} {:>9}",
                    r.run,
                    num(r.world_size.map(u64::from)),
                    num(r.last_step),
                    ago(r.last_seen_ms),
                    human_bytes(r.bytes),
                    r.alerts_firing,
                    r.agent_version.as_deref().unwrap_or("-"),
                )?;
            }
            writeln!(out, "{} run(s)", runs.len())?;
        }
        RunsAction::Delete { runs, yes } => {
            if !yes {
                if !io::stdin().is_terminal() {
                    return Err(Error::bad(
                        "refusing to delete without confirmation: pass --yes (stdin is not a terminal)",
                    ));
                }
                write!(out, "Delete {} and all its data? [y/N] ", runs.join(", "))?;
                out.flush()?;
                let mut line = String::new();
                io::stdin().lock().read_line(&mut line)?;
                if !matches!(line.trim(), "y" | "Y" | "yes") {
                    writeln!(out, "nothing deleted")?;
                    return Ok(());
                }
            }
            for run in runs {
                let d: Deleted = call(
                    remote,
                    "DELETE",
                    &format!("/api/v1/runs/{}", encode(run)),
                    None,
                )?;
                writeln!(
                    out,
                    "deleted {run}: {} rows, {} files ({}), {} alerts",
                    d.rows,
                    d.files,
                    human_bytes(d.bytes),
                    d.alerts
                )?;
            }
        }
        RunsAction::Prune {
            older_than,
            max_bytes,
            dry_run,
        } => {
            let request = RetentionRequest {
                max_age: older_than.map(|age| format!("{}s", age.as_secs())),
                max_bytes: max_bytes.map(ByteSize::Bytes),
                dry_run: *dry_run,
            };
            let report: RetentionReport =
                call(remote, "POST", "/api/v1/retention", Some(&request))?;
            let verb = if *dry_run { "would delete" } else { "deleted" };
            for d in &report.deleted {
                let reason = match d.reason {
                    rankwatch_api::RetentionReason::Age => "age",
                    rankwatch_api::RetentionReason::Size => "size",
                };
                writeln!(
                    out,
                    "{verb} {} ({reason}, last seen {}, {})",
                    d.run,
                    ago(Some(d.last_seen_ms)),
                    human_bytes(d.bytes),
                )?;
            }
            writeln!(
                out,
                "{verb} {} run(s); {} left",
                report.deleted.len(),
                human_bytes(report.bytes_left)
            )?;
            if let Some(why) = &report.over_cap {
                writeln!(out, "warning: {why}")?;
            }
        }
    }
    Ok(())
}

/// `rankwatch attach RUN` / `rankwatch detach RUN`: records the wish at the collector, where
/// the run's dormant agents poll it; they act at the end of an optimizer step.
pub fn switch_probes(remote: &Remote, run: &str, on: bool, out: &mut dyn Write) -> Result<()> {
    let answer: ProbeSwitch = call(
        remote,
        "PUT",
        &format!("/api/v1/runs/{}/probes", encode(run)),
        Some(&SetProbes { on }),
    )?;
    writeln!(
        out,
        "{run}: probes {} (revision {}); its agents follow within a few steps",
        if on { "on" } else { "off" },
        answer.revision
    )?;
    Ok(())
}

/// `rankwatch export RUN`: streams the file to a temporary name and renames it when complete.
pub fn export(args: &ExportArgs) -> Result<PathBuf> {
    let remote = &args.remote;
    let url = format!(
        "{}/api/v1/runs/{}/export?format={}&table={}",
        remote.url.trim_end_matches('/'),
        encode(&args.run),
        args.format,
        args.table
    );
    let mut answer = authorized(agent().get(&url), remote)
        .call()
        .map_err(|e| unreachable(&remote.url, e))?;
    let status = answer.status().as_u16();
    if !(200..300).contains(&status) {
        let text = answer.body_mut().read_to_string().unwrap_or_default();
        return Err(refusal(status, &text));
    }
    let mut body = answer.body_mut().with_config().limit(u64::MAX).reader();
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}.{}.{}", args.run, args.table, args.format)));
    if output == Path::new("-") {
        io::copy(&mut body, &mut io::stdout().lock())
            .map_err(|e| Error::Remote(format!("the download failed: {e}")))?;
        return Ok(output);
    }
    let tmp = output.with_extension(format!("{}.partial", args.format));
    let copied = (|| -> io::Result<()> {
        let mut file = File::create(&tmp)?;
        let mut buffer = vec![0u8; 256 * 1024];
        loop {
            let n = body.read(&mut buffer)?;
            if n == 0 {
                break;
            }
            file.write_all(&buffer[..n])?;
        }
        file.sync_all()
    })();
    if let Err(e) = copied {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Remote(format!(
            "the download failed and nothing was written to {}: {e}",
            output.display()
        )));
    }
    std::fs::rename(&tmp, &output)?;
    Ok(output)
}
