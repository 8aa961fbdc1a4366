//! A Go client of the contract, generated on this machine by the commands
//! docs/contract.md documents (the pinned protoc-gen-go and protoc-gen-go-grpc, then
//! `buf generate --template buf.gen.go.yaml`) from the checkout's proto, walks the
//! reference provider as a process: the third language beside Rust and Python. The walk
//! itself is `integration/go-client/main.go`; it exits non-zero naming the first answer
//! the contract does not allow.

use std::path::{Path, PathBuf};
use std::process::Command;

use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_integration::tools;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `PATH` with the tools' bin directory (buf runs the plugins from there) and Go.
fn path_with_tools() -> String {
    let mut dirs = vec![tools::bin_dir().unwrap()];
    dirs.extend(["/usr/local/go/bin", "/usr/lib/go/bin"].map(PathBuf::from));
    let old = std::env::var_os("PATH").unwrap_or_default();
    dirs.extend(std::env::split_paths(&old));
    std::env::join_paths(dirs).unwrap().into_string().unwrap()
}

fn run(command: &mut Command, what: &str) -> String {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn a_go_client_generated_as_documented_walks_the_reference_provider() {
    for plugin in ["buf", "protoc-gen-go", "protoc-gen-go-grpc"] {
        tools::bin(plugin).unwrap();
    }
    let path = path_with_tools();
    let work = tempfile::tempdir().unwrap();
    for file in ["main.go", "go.mod", "go.sum"] {
        std::fs::copy(
            repo().join("integration/go-client").join(file),
            work.path().join(file),
        )
        .unwrap();
    }
    run(
        Command::new(tools::bin("buf").unwrap())
            .args(["generate", "--template", "buf.gen.go.yaml", "-o"])
            .arg(work.path())
            .current_dir(repo())
            .env("PATH", &path),
        "buf generate --template buf.gen.go.yaml",
    );
    let client = work.path().join("go-client");
    run(
        Command::new("go")
            .args(["build", "-o"])
            .arg(&client)
            .arg(".")
            .current_dir(work.path())
            .env("PATH", &path)
            .env("GOFLAGS", "-mod=readonly"),
        "go build of the generated client",
    );

    let provider =
        ReferenceProvider::start(&["--provisioning-delay", "200ms", "--deleting-delay", "300ms"])
            .unwrap();
    let walked = run(
        Command::new(&client).args([
            "-endpoint",
            provider.address(),
            "-machine-type",
            "small",
            "-image",
            "debian-12",
            "-running-timeout",
            "10s",
        ]),
        "the Go client's walk",
    );
    println!("{walked}");
    for step in [
        "ok: health: SERVING",
        "contract 1.",
        "ok: conflict: ALREADY_EXISTS",
        "ok: invalid: INVALID_ARGUMENT naming key",
        "ok: running at 127.0.0.1",
        "naming page_token",
        "ok: delete: twice, then NOT_FOUND",
        "every step kept the contract",
    ] {
        assert!(walked.contains(step), "{step:?} missing from:\n{walked}");
    }
}

/// The `go install` lines of `docs/contract.md` and of the Go client's comment name the
/// plugin versions the tools script builds, which the test above runs: a newcomer who
/// copies the documented commands gets the code CI proved.
#[test]
fn the_documented_plugin_versions_are_the_ones_ci_builds() {
    let read = |path: &str| std::fs::read_to_string(repo().join(path)).unwrap();
    let script = read("integration/tools/install-go-tools.sh");
    let pinned = |variable: &str| {
        script
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{variable}=")))
            .unwrap_or_else(|| panic!("install-go-tools.sh sets no {variable}"))
            .trim()
            .to_owned()
    };
    let wanted = [
        format!(
            "go install google.golang.org/protobuf/cmd/protoc-gen-go@{}",
            pinned("PROTOC_GEN_GO_VERSION")
        ),
        format!(
            "go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@{}",
            pinned("PROTOC_GEN_GO_GRPC_VERSION")
        ),
    ];
    for document in ["docs/contract.md", "integration/go-client/main.go"] {
        let text = read(document);
        let documented: Vec<&str> = text
            .lines()
            .filter_map(|line| line.find("go install ").map(|at| line[at..].trim_end()))
            .collect();
        assert_eq!(
            documented, wanted,
            "{document}'s `go install` lines differ from install-go-tools.sh's versions"
        );
    }
}
