//! The rule of docs/ARCHITECTURE.md "Modules import downward", checked
//! for this crate, the engine below it and every other crate of the
//! workspace (replica, sim, format, nbd, and the `vouch` binary): no import
//! circle spans more than two modules.
//!
//! A module is a file of `src/` (`lib.rs` is the root, `main.rs` a
//! binary's; a child file such
//! as `volume/device.rs` is module `volume/device`, part of its parent:
//! the parent's use of its own children is not an import). A module
//! imports module `m` where its code (tests excluded: everything from the
//! first `#[cfg(test)]` on) names a path `crate::m…` or `super::m…`; a
//! path to an item of the root (`crate::Item`) imports the root. The root's `pub use` re-exports are the crate's face to its
//! users, not imports. A circle is a strongly connected component of that
//! graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[test]
fn no_import_circle_of_more_than_two_mirror_modules() {
    check(&crate_src("mirror"));
}

/// Shared types live in leaf modules, so the engine's storage, its
/// bookkeeping and its structures import downward too (the circle
/// `backing -> written -> {state, encryption} -> backing` once went
/// through the block size and `encryption::generation_damaged_from`).
#[test]
fn no_import_circle_of_more_than_two_engine_modules() {
    check(&crate_src("engine"));
}

#[test]
fn no_import_circle_of_more_than_two_modules_in_replica_sim_or_format() {
    for name in ["replica", "sim", "format"] {
        check(&crate_src(name));
    }
}

/// The NBD server's connection code (`transmission`) answers the requests
/// an export finishes later through completions the `Export` trait names:
/// those live in a leaf (`completion`), so the export, the handshake and
/// the metrics do not import the transmission back (they once formed a
/// circle of four with it).
#[test]
fn no_import_circle_of_more_than_two_nbd_modules() {
    check(&crate_src("nbd"));
}

/// What the commands share (size parsing, the create options, opening a
/// volume with its key, the progress bar) lives in leaf modules, not in
/// `main` or one command's module (a circle of seven once ran through
/// `main`, `commands`, `key`, `migrate`, `mirror`, `replica` and
/// `resync`).
#[test]
fn no_import_circle_of_more_than_two_modules_in_the_vouch_binary() {
    check(&crate_src("vouch"));
}

/// `crates/NAME/src` of this workspace.
fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(name)
        .join("src")
}

fn check(src: &Path) {
    let graph = imports(src);
    let circles: Vec<Vec<String>> = strongly_connected(&graph)
        .into_iter()
        .filter(|circle| circle.len() > 2)
        .collect();
    assert!(
        circles.is_empty(),
        "{}: import circles of more than two modules (each module listed with what it imports); \
         move the shared types to a leaf module or pass a value or a trait down: {}",
        src.display(),
        circles
            .iter()
            .map(|circle| circle
                .iter()
                .map(|module| format!("{module} -> {:?}", graph[module]))
                .collect::<Vec<_>>()
                .join("; "))
            .collect::<Vec<_>>()
            .join(" | ")
    );
}

/// Module (its file's path under `src/`, without `.rs` or `/mod.rs`) ->
/// the modules it imports.
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let root = if src.join("lib.rs").exists() {
        "lib"
    } else {
        "main"
    };
    let mut files = Vec::new();
    collect_files(src, &mut files);
    assert!(!files.is_empty(), "no sources under {}", src.display());
    let module_of = |file: &Path| -> String {
        let relative = file
            .strip_prefix(src)
            .expect("under src")
            .with_extension("");
        let name = relative.to_string_lossy().to_string();
        name.strip_suffix("/mod").unwrap_or(&name).to_string()
    };
    let modules: BTreeSet<String> = files.iter().map(|file| module_of(file)).collect();
    // `crate::a::b::c` names module `a/b` if there is one, else `a`; the
    // root if `a` is an item of it.
    let resolve = |path: &[String]| -> String {
        (1..=path.len())
            .rev()
            .map(|len| path[..len].join("/"))
            .find(|name| modules.contains(name))
            .unwrap_or_else(|| root.to_string())
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    for file in &files {
        let module = module_of(file);
        let text = std::fs::read_to_string(file).expect("read a source file");
        let mut code = without_comments(text.split("#[cfg(test)]").next().unwrap_or(""));
        if module == root {
            code = without_re_exports(&code);
        }
        // `super::` is the parent of the file's module (the root for a
        // top-level file); a parent's own children are part of it.
        let parent: Vec<String> = match module.rsplit_once('/') {
            Some((parent, _)) => parent.split('/').map(String::from).collect(),
            None => Vec::new(),
        };
        let mut targets = Vec::new();
        for path in paths(&code, "crate::") {
            targets.push(resolve(&path));
        }
        if module != root {
            for path in paths(&code, "super::") {
                targets.push(resolve(&[parent.clone(), path].concat()));
            }
        }
        for target in targets {
            let own_child = target.starts_with(&format!("{module}/"));
            if target != module && !own_child {
                graph.get_mut(&module).expect("a module").insert(target);
            }
        }
    }
    graph
}

fn collect_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read a source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            collect_files(&path, files);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
}

fn without_comments(code: &str) -> String {
    code.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `code` without its `pub use …;` statements.
fn without_re_exports(code: &str) -> String {
    let mut kept = String::new();
    let mut rest = code;
    while let Some(start) = rest.find("pub use ") {
        kept.push_str(&rest[..start]);
        let end = rest[start..]
            .find(';')
            .map_or(rest.len(), |end| start + end + 1);
        rest = &rest[end..];
    }
    kept.push_str(rest);
    kept
}

/// The leading segments (`a::b::` of `prefix a::b::c`) of every path
/// starting with `prefix` in `code`, each path of a `prefix{a::b, c}`
/// group included.
fn paths(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let segments = |text: &str| -> Vec<String> {
        let mut segments = Vec::new();
        let mut rest = text;
        loop {
            let ident: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if ident.is_empty() || ident == "self" {
                break;
            }
            rest = &rest[ident.len()..];
            segments.push(ident);
            match rest.strip_prefix("::") {
                Some(after) => rest = after,
                None => break,
            }
        }
        segments
    };
    let mut paths = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // the end of a longer path (`my_crate::`, `a::super::`)
        }
        let after = &code[at + prefix.len()..];
        if let Some(group) = after.strip_prefix('{') {
            let mut depth = 0usize;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if c.is_whitespace() => {}
                    _ if item_start && depth == 0 => {
                        paths.push(segments(&group[i..]));
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            paths.push(segments(after));
        }
    }
    paths.retain(|path| !path.is_empty());
    paths
}

/// Tarjan's strongly connected components, each sorted.
fn strongly_connected(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, node: &'a str) {
            let n = self.index.len();
            self.index.insert(node, n);
            self.low.insert(node, n);
            self.stack.push(node);
            self.on_stack.insert(node);
            for next in &self.graph[node] {
                let next = next.as_str();
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node, low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                while let Some(top) = self.stack.pop() {
                    self.on_stack.remove(top);
                    component.push(top.to_string());
                    if top == node {
                        break;
                    }
                }
                component.sort();
                self.components.push(component);
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for node in graph.keys() {
        if !walk.index.contains_key(node.as_str()) {
            walk.visit(node);
        }
    }
    walk.components
}
