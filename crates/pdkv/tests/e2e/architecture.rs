//! ARCHITECTURE.md against the workspace: its crate diagram (the fenced
//! block tagged `crates`) lists exactly the workspace's crates and each
//! one's `[dependencies]` on the others (dev-dependencies left out), every
//! dependency below the crate that uses it; and every crate has a heading
//! of its own. The Cargo.toml files are read as text (they are simple: a
//! `members` array, `name = "..."`, one dependency per line or a
//! `[dependencies.NAME]` table), so this test needs no TOML parser.
//!
//! When it fails it prints the block as it should read, ready to paste.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// A crate and the workspace crates it depends on.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// The info string of the diagram's fenced block.
const DIAGRAM_TAG: &str = "crates";

#[test]
fn crate_diagram_lists_the_workspace_crates_and_their_dependencies() {
    let root = workspace_root();
    let actual = workspace_graph(&root);
    let doc = read(&root.join("ARCHITECTURE.md"));
    let expected_block = render(&actual);
    let lines = match diagram_lines(&doc) {
        Ok(lines) => lines,
        Err(e) => panic!("ARCHITECTURE.md: {e}; it should read:\n\n{expected_block}"),
    };
    let problems = check_diagram(&lines, &actual);
    assert!(
        problems.is_empty(),
        "ARCHITECTURE.md's crate diagram is out of date:\n- {}\n\nIt should read:\n\n{expected_block}",
        problems.join("\n- ")
    );
}

#[test]
fn every_workspace_crate_has_a_heading() {
    let root = workspace_root();
    let crates: BTreeSet<String> = workspace_graph(&root).into_keys().collect();
    let doc = read(&root.join("ARCHITECTURE.md"));
    let headed: BTreeSet<String> = doc
        .lines()
        .filter(|l| l.starts_with("## "))
        .filter_map(first_code_span)
        .filter(|name| name.starts_with("pdkv"))
        .map(str::to_string)
        .collect();
    let missing: Vec<_> = crates.difference(&headed).collect();
    let unknown: Vec<_> = headed.difference(&crates).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "ARCHITECTURE.md: crates without a `## `name` — ...` heading: {missing:?}; \
         headings naming no workspace crate: {unknown:?}"
    );
}

/// The first directory upwards from this crate whose Cargo.toml has a
/// `[workspace]` table.
fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|d| {
            fs::read_to_string(d.join("Cargo.toml"))
                .is_ok_and(|t| t.lines().any(|l| l.trim() == "[workspace]"))
        })
        .unwrap_or_else(|| panic!("no workspace Cargo.toml above {}", here.display()))
        .to_path_buf()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every member's package name and its normal dependencies on other members.
fn workspace_graph(root: &Path) -> Graph {
    let manifests: Vec<String> = members(&read(&root.join("Cargo.toml")))
        .iter()
        .flat_map(|m| expand_member(root, m))
        .map(|dir| read(&dir.join("Cargo.toml")))
        .collect();
    let names: BTreeSet<String> = manifests.iter().map(|t| package_name(t)).collect();
    manifests
        .iter()
        .map(|t| {
            let deps = dependencies(t)
                .into_iter()
                .filter(|d| names.contains(d))
                .collect();
            (package_name(t), deps)
        })
        .collect()
}

/// The strings of the root manifest's `members = [...]` (over one line or
/// several).
fn members(root_toml: &str) -> Vec<String> {
    let start = root_toml
        .lines()
        .scan(0, |at, l| {
            let here = *at;
            *at += l.len() + 1;
            Some((here, l))
        })
        .find(|(_, l)| key_of(l) == Some("members"))
        .map(|(at, _)| at)
        .expect("the root Cargo.toml has no `members = [...]`");
    let rest = &root_toml[start..];
    let open = rest.find('[').expect("`members` is not an array");
    let close = open + rest[open..].find(']').expect("`members` is not closed");
    quoted_strings(&rest[open..close])
}

/// A member path, or the directories a trailing `/*` names.
fn expand_member(root: &Path, member: &str) -> Vec<PathBuf> {
    let Some(parent) = member.strip_suffix("/*") else {
        return vec![root.join(member)];
    };
    let mut dirs: Vec<PathBuf> = fs::read_dir(root.join(parent))
        .unwrap_or_else(|e| panic!("listing {parent}: {e}"))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// `name = "..."` in the `[package]` table.
fn package_name(toml: &str) -> String {
    sections(toml)
        .filter(|(section, _)| *section == "package")
        .find_map(|(_, line)| match key_of(line) {
            Some("name") => quoted_strings(line).into_iter().next(),
            _ => None,
        })
        .unwrap_or_else(|| panic!("a member's Cargo.toml has no package name:\n{toml}"))
}

/// The names of a manifest's normal dependencies: keys of `[dependencies]`
/// and `[target.'...'.dependencies]`, and `[dependencies.NAME]` tables; a
/// `package = "..."` rename counts as the package it names.
fn dependencies(toml: &str) -> BTreeSet<String> {
    let mut deps = BTreeSet::new();
    let mut table_dep: Option<String> = None;
    for (section, line) in sections(toml) {
        if let Some(name) = section.strip_prefix("dependencies.") {
            if table_dep.as_deref() != Some(name) {
                table_dep = Some(name.to_string());
                deps.insert(unquote(name));
            }
            if key_of(line) == Some("package") {
                deps.remove(&unquote(name));
                deps.extend(quoted_strings(line).into_iter().next());
            }
            continue;
        }
        let normal = section == "dependencies"
            || (section.starts_with("target.") && section.ends_with(".dependencies"));
        if !normal {
            continue;
        }
        let Some(key) = key_of(line) else { continue };
        let name = unquote(key.split('.').next().unwrap_or(key));
        let value = line.split_once('=').map_or("", |(_, v)| v);
        deps.insert(renamed_package(value).unwrap_or(name));
    }
    deps
}

/// The `package = "..."` of an inline table value, if any.
fn renamed_package(value: &str) -> Option<String> {
    value
        .split(['{', ','])
        .find_map(|field| match field.split_once('=') {
            Some((k, v)) if k.trim() == "package" => quoted_strings(v).into_iter().next(),
            _ => None,
        })
}

/// Each non-blank, non-comment line with the table it is in (`""` before
/// the first header). A header's own line is not yielded, but a
/// `[dependencies.NAME]` table is yielded once with an empty line, so a
/// table with no keys still counts.
fn sections(toml: &str) -> impl Iterator<Item = (&str, &str)> {
    let mut section = "";
    toml.lines().filter_map(move |raw| {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        if let Some(header) = line.strip_prefix('[') {
            section = header.trim_start_matches('[').split(']').next()?.trim();
            return section
                .starts_with("dependencies.")
                .then_some((section, ""));
        }
        Some((section, line))
    })
}

/// The key of a `key = value` line (`name.workspace = true` gives
/// `name.workspace`).
fn key_of(line: &str) -> Option<&str> {
    let (key, _) = line.split_once('=')?;
    let key = key.trim();
    let bare = !key.is_empty() && !key.contains(['{', '[', '"']);
    (bare || key.starts_with('"')).then_some(key)
}

fn unquote(s: &str) -> String {
    s.trim().trim_matches('"').trim_matches('\'').to_string()
}

/// The `"..."` strings in `s`, in order.
fn quoted_strings(s: &str) -> Vec<String> {
    s.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The text between the first pair of backticks of a line.
fn first_code_span(line: &str) -> Option<&str> {
    line.split('`').nth(1)
}

/// The lines of the one fenced block tagged `crates`.
fn diagram_lines(doc: &str) -> Result<Vec<&str>, String> {
    let fence = format!("```{DIAGRAM_TAG}");
    let mut blocks = Vec::new();
    let mut lines = doc.lines();
    while let Some(l) = lines.next() {
        if l.trim_end() == fence {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| l.trim_end() != "```")
                .filter(|l| !l.trim().is_empty())
                .collect();
            blocks.push(body);
        }
    }
    match blocks.len() {
        1 => Ok(blocks.pop().unwrap_or_default()),
        0 => Err(format!("no crate diagram (a block fenced with {fence})")),
        n => Err(format!(
            "{n} blocks fenced with {fence}, where one is expected"
        )),
    }
}

/// What the diagram's lines get wrong about `actual`, in words.
fn check_diagram(lines: &[&str], actual: &Graph) -> Vec<String> {
    let mut problems = Vec::new();
    let mut listed = Graph::new();
    let mut order = Vec::new();
    for line in lines {
        let (name, deps) = match line.split_once("->") {
            Some((name, deps)) => (name.trim(), deps),
            None => (line.trim(), ""),
        };
        let deps: BTreeSet<String> = deps
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(str::to_string)
            .collect();
        if listed.insert(name.to_string(), deps).is_some() {
            problems.push(format!("`{name}` has two lines"));
        }
        order.push(name);
    }
    for name in actual.keys().filter(|n| !listed.contains_key(*n)) {
        problems.push(format!("`{name}` is a workspace crate but has no line"));
    }
    for name in listed.keys().filter(|n| !actual.contains_key(*n)) {
        problems.push(format!("`{name}` has a line but is no workspace crate"));
    }
    for (name, deps) in actual {
        let Some(drawn) = listed.get(name) else {
            continue;
        };
        for d in deps.difference(drawn) {
            problems.push(format!("`{name} -> {d}` is missing"));
        }
        for d in drawn.difference(deps) {
            problems.push(format!(
                "`{name} -> {d}` is drawn but `{name}` does not depend on `{d}`"
            ));
        }
    }
    for (at, name) in order.iter().enumerate() {
        for d in &listed[*name] {
            if order[..at].contains(&d.as_str()) {
                problems.push(format!(
                    "`{name} -> {d}` points upwards: list `{d}` below `{name}`"
                ));
            }
        }
    }
    problems
}

/// The diagram as it should read: crates from the top of the graph down
/// (by the length of their longest dependency chain, then by name), each
/// with its dependencies in the same order.
fn render(graph: &Graph) -> String {
    let mut height = BTreeMap::new();
    for name in graph.keys() {
        chain_height(graph, name, &mut height, &mut Vec::new());
    }
    let rank = |n: &String| (std::cmp::Reverse(height[n.as_str()]), n.clone());
    let mut names: Vec<&String> = graph.keys().collect();
    names.sort_by_key(|n| rank(n));
    let mut out = format!("```{DIAGRAM_TAG}\n");
    for name in names {
        let mut deps: Vec<&String> = graph[name].iter().collect();
        deps.sort_by_key(|n| rank(n));
        if deps.is_empty() {
            out.push_str(&format!("{name}\n"));
        } else {
            let deps: Vec<&str> = deps.iter().map(|d| d.as_str()).collect();
            out.push_str(&format!("{name} -> {}\n", deps.join(", ")));
        }
    }
    out.push_str("```\n");
    out
}

/// The number of crates on `name`'s longest dependency chain below it.
fn chain_height<'a>(
    graph: &'a Graph,
    name: &'a str,
    memo: &mut BTreeMap<&'a str, usize>,
    path: &mut Vec<&'a str>,
) -> usize {
    if let Some(&h) = memo.get(name) {
        return h;
    }
    assert!(
        !path.contains(&name),
        "the workspace's dependencies form a cycle: {path:?} -> {name}"
    );
    path.push(name);
    let h = graph[name]
        .iter()
        .map(|d| 1 + chain_height(graph, d, memo, path))
        .max()
        .unwrap_or(0);
    path.pop();
    memo.insert(name, h);
    h
}

#[test]
fn the_manifest_reader_understands_each_dependency_form() {
    let toml = r#"
[package]
name = "a"
version.workspace = true

[dependencies]
b.workspace = true
"c" = { path = "../c" }
d = { workspace = true, features = ["x"] }
e2 = { package = "e", path = "../e" }
# f.workspace = true

[target.'cfg(unix)'.dependencies]
g = "1"

[dependencies.h]
workspace = true

[dev-dependencies]
i.workspace = true

[build-dependencies]
j = "1"
"#;
    assert_eq!(package_name(toml), "a");
    let deps: Vec<String> = dependencies(toml).into_iter().collect();
    assert_eq!(deps, ["b", "c", "d", "e", "g", "h"]);
    let root = "[workspace]\nmembers = [\n  \"crates/x\",\n  \"crates/y\", # z\n]\ndefault-members = [\"crates/y\"]\n";
    assert_eq!(members(root), ["crates/x", "crates/y"]);
}

#[test]
fn the_diagram_check_names_each_mistake() {
    let graph: Graph = [
        ("top", vec!["mid", "low"]),
        ("mid", vec!["low"]),
        ("low", vec![]),
    ]
    .into_iter()
    .map(|(n, d)| (n.to_string(), d.into_iter().map(str::to_string).collect()))
    .collect();
    let block = render(&graph);
    assert_eq!(block, "```crates\ntop -> mid, low\nmid -> low\nlow\n```\n");
    let doc = format!("# Doc\n\n{block}\ntext\n");
    let lines = diagram_lines(&doc).unwrap();
    assert!(check_diagram(&lines, &graph).is_empty());
    let wrong = ["low -> mid", "mid", "top -> mid, low, gone", "extra"];
    assert_eq!(
        check_diagram(&wrong, &graph),
        [
            "`extra` has a line but is no workspace crate",
            "`low -> mid` is drawn but `low` does not depend on `mid`",
            "`mid -> low` is missing",
            "`top -> gone` is drawn but `top` does not depend on `gone`",
            "`top -> low` points upwards: list `low` below `top`",
            "`top -> mid` points upwards: list `mid` below `top`",
        ]
    );
}
