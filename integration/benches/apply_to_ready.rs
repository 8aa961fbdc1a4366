//! Benchmark: apply → Ready of a Proxy on the real path, against its floor.
//!
//! 1. Starts the end-to-end stack (its pool starts empty) and applies a Proxy: the
//!    first apply downloads the image (cold).
//! 2. Keeps the domain's XML (`virsh dumpxml --inactive`) and a copy of its seed, deletes
//!    the Proxy, and applies it again (warm: the base is cached).
//! 3. The floor: the same image and the same domain XML (renamed, a new overlay on the
//!    same base, the same seed, fresh NVRAM) defined and started by hand with virsh,
//!    until squid answers a proxied request.
//! 4. Prints each apply broken into image fetch, Create, boot to the guest agent's
//!    address, squid answering, and the operator's own delays (noticing RUNNING, the
//!    health check), beside the floor; exits non-zero when warm apply → Ready is more
//!    than 1.1× the floor.
//! 5. Prints, for the warm apply and the floor (each until squid first answers), the
//!    CPU seconds the guest's QEMU used and those everything else used meanwhile (the
//!    stack, this benchmark, the rest of the machine; [`cpu`]): a TCG guest boots on
//!    the same two cores, so CPU taken from it shows up as boot time, and a miss names
//!    its cause.
//!
//! Both measurements look the same way: `virsh domifaddr` through the guest agent and a
//! proxied `curl` every 200 ms until each answers. The Proxy's readiness comes from a
//! watch, not from polling kubectl, whose process would take CPU from the guest that the
//! floor's boot does not lose.
//!
//! Runs as root (see `integration/tests/e2e_proxy.rs`); `make bench` runs it.
//!
//! With `--reference` it measures only the operator's part, with no VM: the time from
//! the provider reporting RUNNING with an address to the Proxy's Ready, against the
//! reference provider, beside its target of 0.5 s plus one health check
//! ([`running_to_ready`]; `cargo bench -p egressproxy-integration --bench
//! apply_to_ready -- --reference`).

#[path = "apply_to_ready/running_to_ready.rs"]
mod running_to_ready;

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use egressproxy_integration::cpu::{self, CpuUse};
use egressproxy_integration::e2e::pool_view::follow_ready_proxies;
use egressproxy_integration::e2e::stack::{HOST, IMAGE, MACHINE_TYPE, PROVIDER, Stack};
use egressproxy_integration::e2e::timeline::Timeline;

const TARGET_RATIO: f64 = 1.1;
const WAIT: Duration = Duration::from_secs(900);
const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Default)]
struct Apply {
    ready: f64,
    image_download: Option<f64>,
    create: Option<f64>,
    address: Option<f64>,
    squid: Option<f64>,
    first_get_after_address: Option<f64>,
    /// From the apply until squid first answered: the floor's window.
    cpu: Option<CpuUse>,
}

fn unix_nanos(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()).unwrap_or(0)
}

fn secs(nanos: u64, from: u64) -> f64 {
    nanos.saturating_sub(from) as f64 / 1e9
}

fn manifest(stack: &Stack, name: &str) -> String {
    format!(
        "apiVersion: egressproxy.dev/v1alpha1\n\
         kind: Proxy\n\
         metadata: {{name: {name}}}\n\
         spec:\n\
         \x20 provider: {PROVIDER}\n\
         \x20 placement: {{host: {HOST}, machineType: {MACHINE_TYPE}, image: {IMAGE}}}\n\
         \x20 healthCheck: {{type: Http, url: \"{url}\", periodSeconds: 5, timeoutSeconds: 3}}\n",
        url = stack.target.url(),
    )
}

/// The address the guest agent reports for `domain`, if any yet.
fn agent_address(stack: &Stack, domain: &str) -> Option<String> {
    let out = stack
        .virsh(&["domifaddr", domain, "--source", "agent"])
        .ok()?;
    out.lines()
        .filter(|l| l.contains("ipv4"))
        .filter_map(|l| l.split_whitespace().nth(3))
        .map(|cidr| cidr.split('/').next().unwrap_or_default().to_owned())
        .find(|ip| !ip.starts_with("127."))
}

fn squid_answers(stack: &Stack, address: &str) -> bool {
    stack
        .curl_in_netns(&[
            "-sS",
            "-o",
            "/dev/null",
            "--max-time",
            "2",
            "-x",
            &format!("http://{address}:3128"),
            &stack.target.url(),
        ])
        .is_ok()
}

async fn apply(stack: &Stack, ready: &Timeline<Vec<String>>, name: &str) -> anyhow::Result<Apply> {
    let is_ready = |names: &Vec<String>| names.iter().any(|n| n == name);
    let started_at = unix_nanos(SystemTime::now());
    let cpu_before = cpu::sample()?;
    let started = Instant::now();
    stack.kubectl_apply(&manifest(stack, name))?;
    let mut result = Apply::default();
    let mut domain: Option<String> = None;
    let mut address: Option<String> = None;
    loop {
        anyhow::ensure!(started.elapsed() < WAIT, "{name} not Ready within {WAIT:?}");
        if domain.is_none() {
            domain = stack.domains()?.into_iter().next();
        }
        if let (Some(d), None) = (&domain, &address)
            && let Some(ip) = agent_address(stack, d)
        {
            result.address = Some(started.elapsed().as_secs_f64());
            address = Some(ip);
        }
        if let (Some(ip), None) = (&address, result.squid)
            && squid_answers(stack, ip)
        {
            result.squid = Some(started.elapsed().as_secs_f64());
            result.cpu = Some(cpu::sample()?.since(&cpu_before));
        }
        if ready.latest().as_ref().is_some_and(is_ready) {
            let (at, _) = ready
                .first_after(&format!("{name} Ready"), WAIT, started, is_ready)
                .await?;
            result.ready = at.duration_since(started).as_secs_f64();
            break;
        }
        // The guest agent's address and squid's answer send no event: they are asked
        // every POLL, as the floor asks them.
        tokio::time::sleep(POLL).await;
    }
    // Spans are exported within a second of ending.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spans = stack.spans.spans();
    let after: Vec<_> = spans
        .iter()
        .filter(|s| s.start_unix_nano >= started_at)
        .collect();
    result.image_download = after
        .iter()
        .find(|s| s.name == "image download")
        .map(|s| secs(s.end_unix_nano, s.start_unix_nano));
    result.create = after
        .iter()
        .find(|s| s.name.ends_with("/CreateInstance") && s.service == "egressproxy-operator")
        .map(|s| secs(s.end_unix_nano, started_at));
    if let Some(at) = result.address {
        let address_at = started_at + (at * 1e9) as u64;
        result.first_get_after_address = after
            .iter()
            .filter(|s| s.name.ends_with("/GetInstance") && s.start_unix_nano >= address_at)
            .map(|s| secs(s.start_unix_nano, started_at))
            .reduce(f64::min);
    }
    Ok(result)
}

async fn delete(stack: &Stack, name: &str) -> anyhow::Result<()> {
    stack.kubectl(&["delete", "proxy", name, "--wait=false"])?;
    let started = Instant::now();
    while !stack
        .kubectl(&["get", "proxies", "-o", "name"])?
        .trim()
        .is_empty()
    {
        anyhow::ensure!(started.elapsed() < WAIT, "{name} not deleted");
        tokio::time::sleep(POLL).await;
    }
    Ok(())
}

/// Removes the first element `<tag ...>...</tag>` or `<tag .../>` from `xml`.
fn remove_element(xml: &str, tag: &str) -> String {
    let Some(start) = xml.find(&format!("<{tag}")) else {
        return xml.to_owned();
    };
    let rest = &xml[start..];
    let close = format!("</{tag}>");
    let self_closing = rest.find("/>").filter(|i| rest.find('>') == Some(i + 1));
    let end = match (self_closing, rest.find(&close)) {
        (Some(i), _) => i + 2,
        (None, Some(i)) => i + close.len(),
        (None, None) => return xml.to_owned(),
    };
    format!("{}{}", &xml[..start], &xml[start + end..])
}

/// Boots the saved XML by hand and times start → squid answers.
async fn floor(
    stack: &Stack,
    xml: &str,
    overlay: &Path,
    seed: &Path,
) -> anyhow::Result<(f64, f64, CpuUse)> {
    let base = Stack::files_in(&stack.pool_dir())
        .into_iter()
        .find(|f| f.starts_with("egressproxy-base-") && f.ends_with(".img"))
        .map(|f| stack.pool_dir().join(f))
        .ok_or_else(|| anyhow::anyhow!("no cached base"))?;
    let new_overlay = stack.dir().join("floor.root.qcow2");
    let out = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(&base)
        .arg(&new_overlay)
        .arg("3G")
        .output()?;
    anyhow::ensure!(out.status.success(), "qemu-img: {out:?}");
    let seed_in_xml = seed_path_in(xml).ok_or_else(|| anyhow::anyhow!("no seed in the XML"))?;
    let mut xml = xml.to_owned();
    for tag in ["uuid", "mac", "nvram", "metadata"] {
        while xml.contains(&format!("<{tag}")) {
            xml = remove_element(&xml, tag);
        }
    }
    let name_start = xml.find("<name>").unwrap_or(0) + "<name>".len();
    let name_end = xml.find("</name>").unwrap_or(name_start);
    xml.replace_range(name_start..name_end, "floor");
    let xml = xml
        .replace(
            &overlay.display().to_string(),
            &new_overlay.display().to_string(),
        )
        .replace(&seed_in_xml, &seed.display().to_string());
    let file = stack.dir().join("floor.xml");
    std::fs::write(&file, &xml)?;
    stack.virsh(&["define", &file.display().to_string()])?;
    let cpu_before = cpu::sample()?;
    let started = Instant::now();
    stack.virsh(&["start", "floor"])?;
    let mut address = None;
    let mut address_at = 0.0;
    let squid_at = loop {
        anyhow::ensure!(started.elapsed() < WAIT, "the floor VM never answered");
        if address.is_none()
            && let Some(ip) = agent_address(stack, "floor")
        {
            address_at = started.elapsed().as_secs_f64();
            address = Some(ip);
        }
        if let Some(ip) = &address
            && squid_answers(stack, ip)
        {
            break started.elapsed().as_secs_f64();
        }
        tokio::time::sleep(POLL).await;
    };
    let cpu_used = cpu::sample()?.since(&cpu_before);
    let _ = stack.virsh(&["destroy", "floor"]);
    stack.virsh(&["undefine", "floor", "--nvram"])?;
    let _ = std::fs::remove_file(&new_overlay);
    Ok((address_at, squid_at, cpu_used))
}

/// The seed ISO's path in a domain XML (the cdrom's source file).
fn seed_path_in(xml: &str) -> Option<String> {
    let cdrom = xml
        .find("device=\"cdrom\"")
        .or_else(|| xml.find("device='cdrom'"))?;
    let rest = &xml[cdrom..];
    let source = rest.find("file=")? + "file=".len() + 1;
    let end = rest[source..].find(['"', '\''])?;
    Some(rest[source..source + end].to_owned())
}

fn row(what: &str, value: Option<f64>) -> String {
    value.map_or(format!("  {what:<38} -"), |v| {
        format!("  {what:<38} {v:>6.1} s")
    })
}

fn cpu_row(cpu: Option<CpuUse>) -> String {
    const LABEL: &str = "CPU to squid: guest / all else";
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    cpu.map_or(format!("  {LABEL:<38} -"), |c| {
        format!(
            "  {LABEL:<38} {:>6.1} s / {:.1} s of {:.1} core-s",
            c.guests,
            c.besides_guests(),
            c.wall.as_secs_f64() * cores
        )
    })
}

fn print_apply(label: &str, a: &Apply) {
    println!("{label}: apply -> Ready {:.1} s", a.ready);
    println!("{}", row("image download (agent span)", a.image_download));
    println!("{}", row("apply -> CreateInstance answered", a.create));
    println!(
        "{}",
        row("apply -> guest agent reports an address", a.address)
    );
    println!("{}", row("apply -> squid answers (polled)", a.squid));
    println!(
        "{}",
        row(
            "address -> operator's next GetInstance",
            a.first_get_after_address
                .zip(a.address)
                .map(|(g, ad)| g - ad)
        )
    );
    println!(
        "{}",
        row(
            "squid answers -> Ready (health check)",
            a.squid.map(|s| a.ready - s)
        )
    );
    println!("{}", cpu_row(a.cpu));
}

async fn run() -> anyhow::Result<bool> {
    let stack = Stack::start("bench-ready").await?;
    let ready = follow_ready_proxies(&stack);
    let cold = apply(&stack, &ready, "cold").await?;
    let domain = stack
        .domains()?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no domain"))?;
    let xml = stack.virsh(&["dumpxml", "--inactive", &domain])?;
    std::fs::write(stack.dir().join("agent-domain.xml"), &xml)?;
    let seed_in_pool = seed_path_in(&xml).ok_or_else(|| anyhow::anyhow!("no seed in the XML"))?;
    let seed = stack.dir().join("floor.seed.iso");
    std::fs::copy(&seed_in_pool, &seed)?;
    let overlay = stack.pool_dir().join(format!("{domain}.root.qcow2"));
    delete(&stack, "cold").await?;

    let warm = apply(&stack, &ready, "warm").await?;
    delete(&stack, "warm").await?;
    let (floor_address, floor_squid, floor_cpu) = floor(&stack, &xml, &overlay, &seed).await?;

    println!(
        "apply -> Ready against the floor (same image, the agent's domain XML, started by hand)"
    );
    print_apply("cold (image not cached)", &cold);
    print_apply("warm (image cached)", &warm);
    println!(
        "floor: virsh start -> squid answers {floor_squid:.1} s (guest agent address at {floor_address:.1} s)"
    );
    println!("{}", cpu_row(Some(floor_cpu)));
    println!(
        "the agent's domain XML: {}",
        stack.dir().join("agent-domain.xml").display()
    );
    let ratio = warm.ready / floor_squid;
    let met = ratio <= TARGET_RATIO;
    println!(
        "warm apply -> Ready / floor = {ratio:.2}x (target <= {TARGET_RATIO}x): {}",
        if met { "met" } else { "MISSED" }
    );
    tokio::task::spawn_blocking(move || drop(stack)).await?;
    Ok(met)
}

fn main() -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let reference = std::env::args().any(|arg| arg == "--reference");
    let outcome = if reference {
        runtime.block_on(running_to_ready::run())
    } else {
        runtime.block_on(run())
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("apply_to_ready: {error:#}");
            ExitCode::FAILURE
        }
    }
}
