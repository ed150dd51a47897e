//! Command line and environment configuration (`rankwatch serve --help`).
//!
//! Every flag has a `RANKWATCH_*` environment variable and a default that gives an embedded,
//! zero-setup instance: a local data directory and a loopback port.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::error::{Error, Result};

/// rankwatch: training observability for PyTorch jobs.
#[derive(Debug, Parser)]
#[command(name = "rankwatch", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The binary's subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the collector: ingest, storage, queries and /metrics.
    Serve(Box<ServeConfig>),
    /// Create the collector's ingest, read and admin tokens as files in DIR (each once: existing
    /// ones are kept and not shown again), printing the new ones. The compose deployment runs
    /// it at first start and points the collector and Prometheus at the files.
    Tokens {
        /// The directory to keep the token files in (`ingest-token`, `read-token`, `admin-token`).
        #[arg(long, env = "RANKWATCH_TOKEN_DIR")]
        dir: PathBuf,
        /// Make the files readable by every user (0644 instead of 0600): for a volume shared
        /// with a container that runs as another user, such as Prometheus reading the read
        /// token.
        #[arg(long)]
        shared: bool,
    },
    /// Print the alert rules in force as TOML: the documented defaults, or a rules file's
    /// (checked first, like `serve --rules` does).
    Rules {
        /// A rules file to check and show merged over the defaults.
        #[arg(long, env = "RANKWATCH_RULES")]
        rules: Option<PathBuf>,
    },
    /// List or delete the runs of a running collector, or apply a retention policy now.
    Runs {
        #[command(flatten)]
        remote: Remote,
        #[command(subcommand)]
        action: RunsAction,
    },
    /// Download one run's rows from a running collector as Parquet or CSV.
    Export(ExportArgs),
    /// Turn a run's probes on: the agents of a job started with `rankwatch run --dormant`
    /// start measuring within a few steps. `rankwatch attach --pid PID [--run NAME] [--every
    /// ...]` instead injects the agent into a job started without rankwatch (`python -m
    /// rankwatch attach`; ptrace on x86-64, gdb elsewhere, or sys.remote_exec on Python 3.14).
    Attach(SwitchArgs),
    /// Turn a run's probes off: its agents remove every hook within a few steps.
    /// `rankwatch detach --pid PID` does it by process instead.
    Detach(SwitchArgs),
    /// Run a command with the agent in every Python process it starts:
    /// `rankwatch run [--run NAME] [--collector URL] [--every N] [--dormant] -- torchrun ...`
    /// (`python -m rankwatch run`; RANKWATCH_PYTHON names the Python, default python3).
    #[command(disable_help_flag = true)]
    Run {
        /// Options, `--`, and the command; see `python -m rankwatch run --help`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Send what an offline run (or one that lost its collector) left in its spool:
    /// `rankwatch sync SPOOL_DIR [--collector URL]` (`python -m rankwatch sync`).
    #[command(disable_help_flag = true)]
    Sync {
        /// The spool directory and options; see `python -m rankwatch sync --help`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Judge a stored run again under other rules: its exported rows (`rankwatch export`)
    /// through the detectors, one JSON line of alerts per rules file (what the detection
    /// benchmark's threshold sweeps call).
    Replay(ReplayArgs),
    /// Check the environment a job will run in: torch and CUDA, ptrace rights for attach,
    /// the collector, the spool directory (`python -m rankwatch doctor`).
    #[command(disable_help_flag = true)]
    Doctor {
        /// Options; see `python -m rankwatch doctor --help`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// `rankwatch attach|detach RUN`.
#[derive(Debug, Clone, Args)]
pub struct SwitchArgs {
    #[command(flatten)]
    pub remote: Remote,

    /// The run (its agents started with `rankwatch run --dormant`, or attached before).
    pub run: String,
}

/// How the client subcommands reach the collector.
#[derive(Debug, Clone, Args)]
pub struct Remote {
    /// The collector's base URL.
    #[arg(
        long,
        env = "RANKWATCH_URL",
        default_value = "http://127.0.0.1:7070",
        global = true
    )]
    pub url: String,

    /// Bearer token: the read token for listing and export, the admin (or ingest) token for
    /// deletion and retention.
    #[arg(long, env = "RANKWATCH_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
}

/// `rankwatch runs ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum RunsAction {
    /// Every run: last step, last seen, Parquet size, firing alerts.
    List {
        /// Print the collector's JSON answer instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete runs: their data, metadata, alerts and rule overrides.
    Delete {
        /// The runs to delete.
        #[arg(required = true)]
        runs: Vec<String>,
        /// Do not ask for confirmation (required when stdin is not a terminal).
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Apply a retention policy now: the given one, else the collector's own.
    Prune {
        /// Delete runs silent longer than this, e.g. `30d`.
        #[arg(long, value_parser = parse_duration)]
        older_than: Option<Duration>,
        /// Keep the Parquet data under this size (e.g. `50GB`), oldest runs first.
        #[arg(long, value_parser = parse_bytes)]
        max_bytes: Option<u64>,
        /// Show what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// `rankwatch export RUN`.
#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub remote: Remote,

    /// The run to export.
    pub run: String,

    /// File format.
    #[arg(long, value_parser = ["parquet", "csv"], default_value = "parquet")]
    pub format: String,

    /// Which table: the metric samples, or the per-rank gradient sketches.
    #[arg(long, value_parser = ["samples", "sketches"], default_value = "samples")]
    pub table: String,

    /// Output file (default `<run>.<table>.<format>` here; `-` for stdout). Written to a
    /// temporary file first, so a failed download leaves nothing behind.
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
}

/// Arguments of `rankwatch replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The run's samples, as `rankwatch export RUN` writes them (Parquet).
    pub samples: PathBuf,

    /// Its gradient sketches (`rankwatch export RUN --table sketches`), for `cos_pair_mean`.
    #[arg(long)]
    pub sketches: Option<PathBuf>,

    /// A rules file (the shape of `serve --rules`); repeatable: the run is judged once per
    /// file. Without one, the documented defaults.
    #[arg(long)]
    pub rules: Vec<PathBuf>,

    /// Ranks of the world (default: the largest rank in the rows, plus one).
    #[arg(long)]
    pub world_size: Option<u32>,

    /// As `serve --align-timeout`.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub align_timeout: Duration,
}

/// Configuration of `rankwatch serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Directory for the write-ahead log, Parquet tables and manifests.
    #[arg(long, env = "RANKWATCH_DATA_DIR", default_value = "./rankwatch-data")]
    pub data_dir: PathBuf,

    /// Where the Parquet tables and their manifest live: `local` (the data directory) or
    /// `s3://bucket/prefix`, leaving only the write-ahead log on local disk. Collectors sharded
    /// by run may share one prefix: together they write one Hive-partitioned dataset.
    /// Credentials, region and endpoint come from the usual AWS_* variables (AWS_ENDPOINT_URL
    /// and AWS_ALLOW_HTTP=true for an S3-compatible server on plain HTTP).
    #[arg(long, env = "RANKWATCH_STORAGE", default_value = "local")]
    pub storage: String,

    /// This collector's name in object storage (its part and manifest names); must be unique
    /// among the collectors sharing a prefix. Default: the host name.
    #[arg(long, env = "RANKWATCH_NODE_ID")]
    pub node_id: Option<String>,

    /// Take this --node-id over from the collector that holds it in object storage (whose data
    /// directory is gone for good); that collector, if it still runs, stops writing.
    #[arg(long, env = "RANKWATCH_TAKE_OVER_NODE")]
    pub take_over_node: bool,

    /// Address to listen on. A non-loopback address needs both tokens, or --insecure.
    #[arg(long, env = "RANKWATCH_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,

    /// Bearer token required by POST /api/v1/ingest (unset: ingest is open).
    #[arg(long, env = "RANKWATCH_INGEST_TOKEN", hide_env_values = true)]
    pub ingest_token: Option<String>,

    /// Bearer token required by the read API and /metrics (unset: reads are open).
    #[arg(long, env = "RANKWATCH_READ_TOKEN", hide_env_values = true)]
    pub read_token: Option<String>,

    /// Bearer token required to delete runs and apply retention (unset: refused while any
    /// other token is set; with no token at all, deletion is open like the rest).
    #[arg(long, env = "RANKWATCH_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

    /// A file holding the ingest token (its first line); for deployments that keep secrets
    /// in files, e.g. the compose file's `rankwatch tokens` volume. Not with --ingest-token.
    #[arg(long, env = "RANKWATCH_INGEST_TOKEN_FILE")]
    pub ingest_token_file: Option<PathBuf>,

    /// A file holding the read token (its first line). Not with --read-token.
    #[arg(long, env = "RANKWATCH_READ_TOKEN_FILE")]
    pub read_token_file: Option<PathBuf>,

    /// A file holding the admin token (its first line). Not with --admin-token.
    #[arg(long, env = "RANKWATCH_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,

    /// Delete runs that have not reported for this long, e.g. `30d` (unset: kept for ever).
    #[arg(long, env = "RANKWATCH_RETENTION_AGE", value_parser = parse_duration)]
    pub retention_age: Option<Duration>,

    /// Keep the Parquet data under this size, e.g. `50GB` or `200GiB`, deleting the least
    /// recently seen runs first; runs active within --active-window are never deleted for size.
    #[arg(long, env = "RANKWATCH_RETENTION_MAX_BYTES", value_parser = parse_bytes)]
    pub retention_max_bytes: Option<u64>,

    /// How often the retention policy is applied.
    #[arg(long, env = "RANKWATCH_RETENTION_INTERVAL", default_value = "10m", value_parser = parse_duration)]
    pub retention_interval: Duration,

    /// A host name (without port) this collector may be reached by without a token, besides
    /// loopback names and IP addresses; repeat for several. A request without a token naming
    /// another `Host` is refused, whatever the listen address (a guard against DNS rebinding).
    #[arg(
        long = "allowed-host",
        env = "RANKWATCH_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    pub allowed_hosts: Vec<String>,

    /// A web origin (`scheme://host[:port]`) whose pages may change state (post, put, delete)
    /// besides the collector's own dashboard; repeat for several.
    #[arg(
        long = "allowed-origin",
        env = "RANKWATCH_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    pub allowed_origins: Vec<String>,

    /// Allow a non-loopback listen address without tokens.
    #[arg(long, env = "RANKWATCH_INSECURE")]
    pub insecure: bool,

    /// Largest accepted request body, in bytes.
    #[arg(long, env = "RANKWATCH_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,

    /// Largest accepted batch, in rows.
    #[arg(long, env = "RANKWATCH_MAX_BATCH_ROWS", default_value_t = 1_000_000)]
    pub max_batch_rows: usize,

    /// Most distinct series (metric, layer, site, rank) one run may have. The default holds
    /// 1,024 ranks reporting 1,024 series each.
    #[arg(long, env = "RANKWATCH_MAX_SERIES_PER_RUN", default_value_t = 1 << 20)]
    pub max_series_per_run: usize,

    /// Most distinct series all runs together may have (each costs ~60 bytes of the run
    /// index in memory, whatever the run); a batch past it is refused with 422.
    #[arg(long, env = "RANKWATCH_MAX_SERIES", default_value_t = 5_000_000)]
    pub max_series: usize,

    /// Most runs the collector keeps; a batch of a new run beyond it is refused with 422 (each
    /// run costs a summary, files per flush and a branch in every SQL query).
    #[arg(long, env = "RANKWATCH_MAX_RUNS", default_value_t = 100_000)]
    pub max_runs: usize,

    /// Most ranks one run may declare (`world_size`); larger is refused with 400.
    #[arg(long, env = "RANKWATCH_MAX_WORLD_SIZE", default_value_t = 16_384)]
    pub max_world_size: u32,

    /// Hot-buffer size at which a flush to Parquet starts early, in bytes. At twice this size
    /// a batch waits up to --queue-wait for a flush to take the buffer, then gets 429.
    #[arg(long, env = "RANKWATCH_HOT_BUDGET_BYTES", default_value_t = 64 << 20)]
    pub hot_budget_bytes: usize,

    /// How often the hot buffer is flushed to Parquet.
    #[arg(long, env = "RANKWATCH_FLUSH_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub flush_interval: Duration,

    /// How often small Parquet files are compacted.
    #[arg(long, env = "RANKWATCH_COMPACT_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub compact_interval: Duration,

    /// Files with fewer rows than this are merged by compaction.
    #[arg(
        long,
        env = "RANKWATCH_COMPACT_SMALL_ROWS",
        default_value_t = 1_000_000
    )]
    pub compact_small_rows: u64,

    /// Most rows one compaction reads into memory (bounds its peak memory).
    #[arg(long, env = "RANKWATCH_COMPACT_MAX_ROWS", default_value_t = 4_000_000)]
    pub compact_max_rows: u64,

    /// How long a run's idempotency keys are kept after it last sent a new batch: a batch
    /// retried later than this (a spool synced after a month) is stored again.
    #[arg(long, env = "RANKWATCH_IDEMPOTENCY_WINDOW", default_value = "30d", value_parser = parse_duration)]
    pub idempotency_window: Duration,

    /// Size at which the write-ahead log starts a new segment, in bytes.
    #[arg(long, env = "RANKWATCH_WAL_SEGMENT_BYTES", default_value_t = 64 << 20)]
    pub wal_segment_bytes: u64,

    /// A run is "active" for /metrics while it has reported within this window.
    #[arg(long, env = "RANKWATCH_ACTIVE_WINDOW", default_value = "15m", value_parser = parse_duration)]
    pub active_window: Duration,

    /// Most runs exported with a `run` label on /metrics (the most recently seen win).
    #[arg(long, env = "RANKWATCH_MAX_ACTIVE_RUNS", default_value_t = 32)]
    pub max_active_runs: usize,

    /// Rows a /api/v1/sql answer may hold.
    #[arg(long, env = "RANKWATCH_SQL_MAX_ROWS", default_value_t = 10_000)]
    pub sql_max_rows: usize,

    /// Bytes (in Arrow memory) a /api/v1/sql answer may hold: the result stops there and is
    /// marked truncated, so its JSON answer is bounded too. Also what one batch of a query may
    /// hold: a function call's result, a join's or unnest's copies, and 1/8,192 of it a value.
    #[arg(long, env = "RANKWATCH_SQL_MAX_RESULT_BYTES", default_value_t = 64 << 20)]
    pub sql_max_result_bytes: usize,

    /// Time a query may run before it is cancelled.
    #[arg(long, env = "RANKWATCH_QUERY_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub query_timeout: Duration,

    /// Requests handled at once (event streams aside). A request finding none free waits up
    /// to --queue-wait, then gets 429 `busy` with Retry-After.
    #[arg(long, env = "RANKWATCH_MAX_CONCURRENT_REQUESTS", default_value_t = 256)]
    pub max_concurrent_requests: usize,

    /// Ingest bodies being read, decoded and committed at once, in bytes (by their declared
    /// length; a body without one as its bytes arrive); beyond it a batch waits up to
    /// --queue-wait, then gets 429. At least --max-body-bytes.
    #[arg(long, env = "RANKWATCH_MAX_INFLIGHT_BYTES", default_value = "256MiB", value_parser = parse_size)]
    pub max_inflight_bytes: usize,

    /// How long a request waits for a free request slot, room for its body or room in the hot
    /// buffer before 429.
    #[arg(long, env = "RANKWATCH_QUEUE_WAIT", default_value = "2s", value_parser = parse_duration)]
    pub queue_wait: Duration,

    /// Open /api/v1/events streams; more get 429.
    #[arg(long, env = "RANKWATCH_MAX_EVENT_STREAMS", default_value_t = 256)]
    pub max_event_streams: usize,

    /// Exports running at once (each holds a thread while it writes); more get 429.
    #[arg(long, env = "RANKWATCH_MAX_CONCURRENT_EXPORTS", default_value_t = 4)]
    pub max_concurrent_exports: usize,

    /// /api/v1/sql queries running at once; more get 429.
    #[arg(long, env = "RANKWATCH_MAX_CONCURRENT_SQL", default_value_t = 4)]
    pub max_concurrent_sql: usize,

    /// Memory all queries together may hold (DataFusion's memory pool). A sort or join
    /// beyond it spills to disk; what cannot spill fails naming this limit.
    #[arg(long, env = "RANKWATCH_QUERY_MEMORY", default_value = "1GiB", value_parser = parse_size)]
    pub query_memory: usize,

    /// Memory the series and heatmap reads may keep of what they decoded from Parquet parts
    /// (the rows of one read, least recently used out), so that a dashboard asking again does
    /// not decode the same rows again. 0 keeps nothing. Beside it, the parts' series indexes
    /// take up to 64 MiB.
    #[arg(long, env = "RANKWATCH_READ_CACHE_BYTES", default_value = "64MiB", value_parser = parse_size)]
    pub read_cache_bytes: usize,

    /// Connections open at once; beyond it the collector stops accepting until one closes
    /// (kept below the process's open-file limit, which the log and Parquet files need too).
    #[arg(long, env = "RANKWATCH_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,

    /// Connections one client address may hold open at once (0: no per-address cap); past it
    /// a connection is answered 429 and closed, so one host cannot take every connection. A
    /// reverse proxy on the collector's host is one address for all its clients: raise it there.
    #[arg(
        long,
        env = "RANKWATCH_MAX_CONNECTIONS_PER_PEER",
        default_value_t = 512
    )]
    pub max_connections_per_peer: usize,

    /// Time a client has to send a request's head, and how long an idle keep-alive
    /// connection stays open.
    #[arg(long, env = "RANKWATCH_HEADER_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub header_timeout: Duration,

    /// Longest a write to a client may wait for it to read: a connection whose client stops
    /// reading its answers is closed after it (pipelined requests never read held their
    /// connections for ever).
    #[arg(long, env = "RANKWATCH_WRITE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub write_timeout: Duration,

    /// Time a client has to send a request's body in full (408 `timeout` after it), and
    /// longest an export waits for its client to take more data.
    #[arg(long, env = "RANKWATCH_BODY_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub body_timeout: Duration,

    /// Store only: no step aligner, no all-ranks statistics, no alerts (a storage shard whose
    /// runs are analysed by another collector, or a read-only replay).
    #[arg(long, env = "RANKWATCH_NO_ALERT_ENGINE")]
    pub no_alert_engine: bool,

    /// Alert rules: a TOML file naming the thresholds it changes from the documented defaults
    /// (docs/detection.md). Checked at start; a bad file stops the collector with its line.
    #[arg(long, env = "RANKWATCH_RULES")]
    pub rules: Option<PathBuf>,

    /// The step aligner closes a step this long after its first row even if some rank never
    /// reported it (those ranks are counted in `ranks_missing`).
    #[arg(long, env = "RANKWATCH_ALIGN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub align_timeout: Duration,

    /// Runs silent this long are dropped from the alert engine's memory.
    #[arg(long, env = "RANKWATCH_IDLE_EVICT", default_value = "1h", value_parser = parse_duration)]
    pub idle_evict: Duration,

    /// Most alerts one run may have open (pending or firing) at once; further ones are counted
    /// (`rankwatch_alerts_suppressed_total`), not raised, until some resolve.
    #[arg(long, env = "RANKWATCH_MAX_OPEN_ALERTS_PER_RUN", default_value_t = 256)]
    pub max_open_alerts_per_run: usize,

    /// Generic JSON webhook receiving alerts as they fire and resolve (repeatable; the
    /// variable takes a comma-separated list).
    #[arg(
        long = "webhook-url",
        env = "RANKWATCH_WEBHOOK_URLS",
        value_delimiter = ',',
        // A webhook URL's path is its secret: `--help` must not print it.
        hide_env_values = true
    )]
    pub webhook_urls: Vec<String>,

    /// Slack incoming-webhook URL (repeatable).
    #[arg(
        long = "slack-webhook-url",
        env = "RANKWATCH_SLACK_WEBHOOK_URLS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub slack_webhook_urls: Vec<String>,

    /// Prometheus Alertmanager base URL, e.g. http://127.0.0.1:9093 (repeatable); alerts are
    /// posted to its /api/v2/alerts.
    #[arg(
        long = "alertmanager-url",
        env = "RANKWATCH_ALERTMANAGER_URLS",
        value_delimiter = ',',
        // It may carry basic-auth credentials.
        hide_env_values = true
    )]
    pub alertmanager_urls: Vec<String>,

    /// How often firing alerts are re-posted to Alertmanager (keep it below its resolve_timeout).
    #[arg(long, env = "RANKWATCH_ALERTMANAGER_RESEND", default_value = "60s", value_parser = parse_duration)]
    pub alertmanager_resend: Duration,

    /// Attempts per alert delivery (exponential backoff from 0.5 s to 30 s) before it is
    /// counted as failed.
    #[arg(long, env = "RANKWATCH_ALERT_MAX_ATTEMPTS", default_value_t = 8)]
    pub alert_max_attempts: u32,

    /// The dashboard's public base URL, for links in alert payloads.
    #[arg(long, env = "RANKWATCH_EXTERNAL_URL")]
    pub external_url: Option<String>,
}

impl ServeConfig {
    /// A configuration with every default and the given data directory (tests, embedding).
    pub fn with_data_dir(data_dir: impl Into<PathBuf>) -> Self {
        let mut config = match Cli::try_parse_from(["rankwatch", "serve"]) {
            Ok(Cli {
                command: Command::Serve(config),
            }) => *config,
            // The defaults above always parse into `serve`; this arm exists for the type checker.
            Err(e) => panic!("default configuration does not parse: {e}"),
            Ok(_) => panic!("`rankwatch serve` parsed as another command"),
        };
        config.data_dir = data_dir.into();
        config
    }

    /// The node id: `--node-id`, else the host name.
    pub fn node_id(&self) -> String {
        self.node_id
            .clone()
            .or_else(crate::fsutil::host_name)
            .unwrap_or_else(|| "collector".to_owned())
    }

    /// Whether the Parquet side lives in object storage.
    pub fn remote_storage(&self) -> Option<&str> {
        (self.storage != "local").then_some(self.storage.as_str())
    }

    /// Reads the `--*-token-file` files into the tokens (their first line, trimmed); a file
    /// given beside its token, unreadable, or empty is refused with its path.
    pub fn read_token_files(&mut self) -> Result<()> {
        for (name, file, token) in [
            ("ingest", &self.ingest_token_file, &mut self.ingest_token),
            ("read", &self.read_token_file, &mut self.read_token),
            ("admin", &self.admin_token_file, &mut self.admin_token),
        ] {
            let Some(path) = file else { continue };
            if token.is_some() {
                return Err(Error::bad(format!(
                    "both --{name}-token and --{name}-token-file are given; keep one"
                )));
            }
            let text = std::fs::read_to_string(path).map_err(|e| {
                Error::bad(format!(
                    "the {name} token file {} cannot be read: {e}",
                    path.display()
                ))
            })?;
            let first = text.lines().next().unwrap_or("").trim();
            if first.is_empty() {
                return Err(Error::bad(format!(
                    "the {name} token file {} is empty",
                    path.display()
                )));
            }
            *token = Some(first.to_owned());
        }
        Ok(())
    }

    /// Refuses configurations that would expose data or cannot work.
    pub fn check(&self) -> Result<()> {
        if let Some(url) = self.remote_storage() {
            crate::store::backend::parse_s3_url(url)?;
            crate::store::backend::check_node_id(&self.node_id())?;
        }
        let ip = self.listen.ip();
        if !ip.is_loopback() && !self.insecure {
            let missing: Vec<&str> = [
                ("--ingest-token", &self.ingest_token),
                ("--read-token", &self.read_token),
            ]
            .into_iter()
            .filter(|(_, t)| t.as_deref().is_none_or(str::is_empty))
            .map(|(flag, _)| flag)
            .collect();
            if !missing.is_empty() {
                return Err(Error::bad(format!(
                    "refusing to listen on non-loopback address {} without {}; set the token(s) or pass --insecure",
                    self.listen,
                    missing.join(" and ")
                )));
            }
        }
        for (name, token) in [
            ("ingest", &self.ingest_token),
            ("read", &self.read_token),
            ("admin", &self.admin_token),
        ] {
            if token.as_deref() == Some("") {
                return Err(Error::bad(format!("the {name} token is empty")));
            }
        }
        for url in self
            .webhook_urls
            .iter()
            .chain(&self.slack_webhook_urls)
            .chain(&self.alertmanager_urls)
        {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(Error::bad(format!(
                    "alert receiver {url:?} is not an http:// or https:// URL"
                )));
            }
        }
        if self.retention_interval.is_zero() {
            return Err(Error::bad("--retention-interval must be positive"));
        }
        if self.retention_age.is_some_and(|a| a.is_zero()) {
            return Err(Error::bad("--retention-age must be positive"));
        }
        if self.align_timeout.is_zero() {
            return Err(Error::bad("--align-timeout must be positive"));
        }
        if self.max_body_bytes == 0
            || self.max_runs == 0
            || self.max_series == 0
            || self.max_batch_rows == 0
            || self.hot_budget_bytes == 0
            || self.max_world_size == 0
        {
            return Err(Error::bad(
                "body, run, batch-row, hot-buffer and world-size limits must be positive",
            ));
        }
        for (flag, n) in [
            ("--max-concurrent-requests", self.max_concurrent_requests),
            ("--max-event-streams", self.max_event_streams),
            ("--max-concurrent-exports", self.max_concurrent_exports),
            ("--max-concurrent-sql", self.max_concurrent_sql),
            ("--max-connections", self.max_connections),
            ("--query-memory", self.query_memory),
        ] {
            if n == 0 {
                return Err(Error::bad(format!("{flag} must be positive")));
            }
        }
        if self.max_inflight_bytes < self.max_body_bytes {
            return Err(Error::bad(format!(
                "--max-inflight-bytes ({}) is below --max-body-bytes ({}): a largest batch could never be admitted",
                self.max_inflight_bytes, self.max_body_bytes
            )));
        }
        if self.header_timeout.is_zero()
            || self.body_timeout.is_zero()
            || self.write_timeout.is_zero()
        {
            return Err(Error::bad(
                "--header-timeout, --body-timeout and --write-timeout must be positive",
            ));
        }
        Ok(())
    }

    /// The API's admission limits these flags describe.
    pub fn admission(&self) -> AdmissionLimits {
        AdmissionLimits {
            max_requests: self.max_concurrent_requests,
            queue_wait: self.queue_wait,
            max_inflight_bytes: self.max_inflight_bytes,
            max_event_streams: self.max_event_streams,
            max_exports: self.max_concurrent_exports,
            max_sql: self.max_concurrent_sql,
            body_timeout: self.body_timeout,
        }
    }

    /// The retention policy these flags describe.
    pub fn retention(&self) -> crate::retention::Policy {
        crate::retention::Policy {
            max_age: self.retention_age,
            max_bytes: self.retention_max_bytes,
            protect: self.active_window,
        }
    }
}

/// What the API takes on at once (see `api::admission`).
#[derive(Debug, Clone, Copy)]
pub struct AdmissionLimits {
    pub max_requests: usize,
    pub queue_wait: Duration,
    pub max_inflight_bytes: usize,
    pub max_event_streams: usize,
    pub max_exports: usize,
    pub max_sql: usize,
    pub body_timeout: Duration,
}

/// [`parse_bytes`] for an in-memory size.
pub fn parse_size(text: &str) -> std::result::Result<usize, String> {
    let n = parse_bytes(text)?;
    usize::try_from(n).map_err(|_| format!("size {text:?} is too large for this machine"))
}

/// Parses `500ms`, `10s`, `5m`, `1h`, `30d`.
pub fn parse_duration(text: &str) -> std::result::Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {text:?} needs a unit (ms, s, m, h, d)"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("duration {text:?} does not start with a number"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        "d" => Ok(Duration::from_secs(n * 86_400)),
        _ => Err(format!(
            "duration {text:?}: unknown unit {unit:?} (ms, s, m, h, d)"
        )),
    }
}

/// Parses a size: `1000`, `500MB`, `50GB` (powers of 1000) or `200GiB` (powers of 1024).
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("size {text:?} does not start with a number"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            return Err(format!(
                "size {text:?}: unknown unit {other:?} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ));
        }
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_bad_ones_are_named() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("15m").unwrap(), Duration::from_secs(900));
        assert!(parse_duration("10").unwrap_err().contains("needs a unit"));
        assert_eq!(
            parse_duration("30d").unwrap(),
            Duration::from_secs(30 * 86_400)
        );
        assert!(parse_duration("10w").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn sizes_parse_and_bad_ones_are_named() {
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_bytes("50GB").unwrap(), 50_000_000_000);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert!(parse_bytes("GB").unwrap_err().contains("number"));
        assert!(parse_bytes("5PB").unwrap_err().contains("unknown unit"));
        assert!(
            parse_bytes("99999999999TB")
                .unwrap_err()
                .contains("too large")
        );
    }

    #[test]
    fn token_files_are_read_and_bad_ones_refused_with_their_reason() {
        let dir = tempfile::tempdir().unwrap();
        let made = crate::tokens::create(dir.path(), false).unwrap();
        let mut config = ServeConfig::with_data_dir(dir.path().join("data"));
        config.ingest_token_file = Some(made[0].1.clone());
        config.read_token_file = Some(made[1].1.clone());
        config.read_token_files().unwrap();
        assert_eq!(config.ingest_token.as_deref(), Some(made[0].2.as_str()));
        assert_eq!(config.read_token.as_deref(), Some(made[1].2.as_str()));
        // Both forms of one token, a missing file, an empty one.
        let e = config.read_token_files().unwrap_err().to_string();
        assert!(
            e.contains("both --ingest-token and --ingest-token-file"),
            "{e}"
        );
        let mut config = ServeConfig::with_data_dir(dir.path().join("data"));
        config.admin_token_file = Some(dir.path().join("missing"));
        let e = config.read_token_files().unwrap_err().to_string();
        assert!(e.contains("cannot be read"), "{e}");
        std::fs::write(dir.path().join("empty"), "\n").unwrap();
        config.admin_token_file = Some(dir.path().join("empty"));
        let e = config.read_token_files().unwrap_err().to_string();
        assert!(e.contains("is empty"), "{e}");
    }

    #[test]
    fn non_loopback_needs_tokens_or_insecure() {
        let mut c = ServeConfig::with_data_dir("/tmp/x");
        assert!(c.check().is_ok());
        c.listen = "0.0.0.0:7070".parse().unwrap();
        let err = c.check().unwrap_err().to_string();
        assert!(err.contains("--ingest-token and --read-token"), "{err}");
        c.ingest_token = Some("a".into());
        let err = c.check().unwrap_err().to_string();
        assert!(
            err.contains("--read-token") && !err.contains("--ingest-token"),
            "{err}"
        );
        c.read_token = Some("b".into());
        assert!(c.check().is_ok());
        c.read_token = None;
        c.insecure = true;
        assert!(c.check().is_ok());
    }
}
