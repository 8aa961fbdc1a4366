//! The image download cut mid-stream: the image server resets the connection halfway
//! through a base the pool does not have yet, until the Proxy's status names the cause;
//! the operator's retry downloads the base again, and the Proxy becomes Ready.

use std::time::Duration;

use egressproxy_integration::e2e::stack::{HOST, PROVIDER, Stack};
use egressproxy_integration::e2e::wait_for;

use crate::support::{assert_one_vm, base_files, delete, events, manifest_placed, wait_ready};

/// An image served at the image server's `/fresh/` URL: no pool has its base yet.
const FRESH_IMAGE: &str = "debian-e2e-fresh";

pub(crate) async fn download_cut_mid_stream(stack: &mut Stack) -> Duration {
    let bases_before = base_files(stack);
    let url = stack.images.fresh_url().to_owned();
    stack.add_agent_image(FRESH_IMAGE, &url).await.unwrap();
    let size = usize::try_from(std::fs::metadata(stack.image()).unwrap().len()).unwrap();
    // Every download is cut until the test has seen the failure reported.
    stack.images.cut_next_downloads(usize::MAX, size / 2);
    let manifest = manifest_placed(stack, "cut", PROVIDER, HOST, FRESH_IMAGE);
    stack.kubectl_apply(&manifest).unwrap();
    wait_for("the download to be cut", Duration::from_secs(180), || {
        stack.images.last_cut().is_some()
    })
    .await;
    let injected = stack.images.last_cut().unwrap();
    wait_for(
        "the Proxy to name the cut download",
        Duration::from_secs(120),
        || {
            stack
                .proxy_field("cut", "{.status.lastError}")
                .contains("download ended after")
        },
    )
    .await;
    let reported = stack.proxy_field("cut", "{.status.lastError}");
    let condition = stack.proxy_field("cut", "{.status.conditions[?(@.type==\"Ready\")]}");
    eprintln!("download-cut: lastError: {reported}\n  Ready: {condition}");
    assert!(
        condition.contains("ProviderUnavailable"),
        "a cut download is retried (ProviderUnavailable): {condition}"
    );
    assert!(
        reported.contains(&format!("of {size}")),
        "the message says how much of the image arrived: {reported}"
    );
    // Between two attempts, nothing of the cut download is left in the pool.
    wait_for(
        "the cut download's volume to be deleted",
        Duration::from_secs(60),
        || base_files(stack) == bases_before,
    )
    .await;
    stack.images.cut_next_downloads(0, 0);
    wait_ready(stack, "cut").await;
    let converged = injected.elapsed();
    assert_one_vm(stack, "cut");
    assert_no_partial_base(stack, &bases_before);
    assert_password_hidden(stack, "cut", &[&reported, &condition]);
    delete(stack, "cut").await;
    converged
}

/// The pool holds the bases it held before, and the fresh image's base complete with
/// its marker: no half-written volume is left of the cut downloads.
fn assert_no_partial_base(stack: &Stack, before: &[String]) {
    let new: Vec<String> = base_files(stack)
        .into_iter()
        .filter(|f| !before.contains(f))
        .collect();
    assert_eq!(
        new.len(),
        2,
        "one new base and its marker, nothing of the cut downloads: {new:?}"
    );
    assert!(new.iter().any(|f| f.ends_with(".complete")), "{new:?}");
}

/// The image server's password is in none of `shown`, the Proxy's Events, or the
/// agent's and the operator's logs.
pub(crate) fn assert_password_hidden(stack: &Stack, proxy: &str, shown: &[&str]) {
    let password = stack.images.password();
    let events = events(stack, proxy);
    for text in shown.iter().copied().chain([events.as_str()]) {
        assert!(
            !text.contains(password),
            "the image password is shown: {text}"
        );
    }
    for log in ["kvm-agent.log", "operator.log"] {
        let text = std::fs::read_to_string(stack.dir().join(log)).unwrap();
        assert!(!text.contains(password), "{log} shows the image password");
    }
}
