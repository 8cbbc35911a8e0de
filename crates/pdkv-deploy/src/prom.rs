//! Reading a Prometheus text exposition (`/metrics`): the one parser of
//! the project's clients of its servers (the lifecycle matrix, the
//! benchmarks, the tests).

use std::collections::BTreeMap;

/// The value of the first sample line `name value`, where `name` may carry
/// its labels (`pdkv_kv_transfers_total{result="ok"}`); `None` when there is
/// no such line.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    samples(text)
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// [`metric`], or a panic that shows the exposition.
pub fn must(text: &str, name: &str) -> f64 {
    metric(text, name).unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
}

/// The sum of every sample of the family `name`, whatever its labels;
/// `None` when it has none.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in samples(text) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = match rest.as_bytes().first() {
            Some(b' ') => rest,
            Some(b'{') => rest.rsplit_once('}').map_or("", |(_, v)| v),
            _ => continue,
        };
        if let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

/// The sums of the samples of the family `name` by the value of its label
/// `label`, in the label's order (`rank` gives a value per rank).
pub fn sums_by_label(text: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut by = BTreeMap::new();
    let key = format!("{label}=\"");
    for line in samples(text) {
        let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, v)) = rest.rsplit_once('}') else {
            continue;
        };
        let Some(value) = labels
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix(key.as_str()))
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        if let Some(v) = v
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *by.entry(value.to_string()).or_insert(0.0) += v;
        }
    }
    by
}

/// The server is idle with every KV block free and none held for transfers.
pub fn quiescent(text: &str) -> bool {
    metric(text, "pdkv_num_requests_running") == Some(0.0)
        && metric(text, "pdkv_num_requests_waiting") == Some(0.0)
        && metric(text, "pdkv_kv_blocks_held") == Some(0.0)
        && metric(text, "pdkv_kv_blocks_free").is_some()
        && metric(text, "pdkv_kv_blocks_free") == metric(text, "pdkv_kv_blocks_total")
}

/// Every KV block is free and no request runs or waits (blocks held for
/// transfers not counted).
pub fn all_blocks_free(text: &str) -> bool {
    metric(text, "pdkv_kv_blocks_free").is_some()
        && metric(text, "pdkv_kv_blocks_free") == metric(text, "pdkv_kv_blocks_total")
        && metric(text, "pdkv_num_requests_running") == Some(0.0)
        && metric(text, "pdkv_num_requests_waiting") == Some(0.0)
}

fn samples(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter(|l| !l.starts_with('#'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP pdkv_a a\n# TYPE pdkv_a gauge\npdkv_a 3\npdkv_ab 9\n\
        pdkv_t{result=\"ok\"} 2\npdkv_t{result=\"failed\",role=\"d\"} 5\n";

    #[test]
    fn a_name_matches_whole_and_labels_are_part_of_it() {
        assert_eq!(metric(TEXT, "pdkv_a"), Some(3.0));
        assert_eq!(metric(TEXT, "pdkv_ab"), Some(9.0));
        assert_eq!(metric(TEXT, "pdkv_t{result=\"ok\"}"), Some(2.0));
        assert_eq!(metric(TEXT, "pdkv_t"), None);
        assert_eq!(metric(TEXT, "pdkv_missing"), None);
    }

    #[test]
    fn a_family_sums_over_its_labels_only() {
        assert_eq!(metric_sum(TEXT, "pdkv_t"), Some(7.0));
        assert_eq!(metric_sum(TEXT, "pdkv_a"), Some(3.0));
        assert_eq!(metric_sum(TEXT, "pdkv_none"), None);
    }

    #[test]
    fn a_family_sums_by_one_label() {
        let text = "pdkv_x{rank=\"0\",dir=\"in\"} 2\npdkv_x{rank=\"1\"} 3\npdkv_x{rank=\"0\"} 4\npdkv_y{rank=\"0\"} 9\n";
        let by = sums_by_label(text, "pdkv_x", "rank");
        assert_eq!(
            by.into_iter().collect::<Vec<_>>(),
            vec![("0".to_string(), 6.0), ("1".to_string(), 3.0)]
        );
        assert!(sums_by_label(text, "pdkv_x", "role").is_empty());
    }

    #[test]
    fn quiescence_needs_every_gauge() {
        let idle = "pdkv_num_requests_running 0\npdkv_num_requests_waiting 0\n\
            pdkv_kv_blocks_held 0\npdkv_kv_blocks_free 8\npdkv_kv_blocks_total 8\n";
        assert!(quiescent(idle) && all_blocks_free(idle));
        let held = idle.replace("held 0", "held 2");
        assert!(!quiescent(&held) && all_blocks_free(&held));
        assert!(!quiescent(&idle.replace("free 8", "free 7")));
        assert!(!quiescent("pdkv_num_requests_running 0\n"));
    }
}
