//! GBNF grammars (rules written `name ::= ...`, as llama.cpp and vLLM's
//! EBNF examples spell them) rewritten as the Lark dialect llguidance
//! compiles: `root` becomes `start`, rule names are lower-cased with `-`
//! as `_`, string literals are re-quoted, character classes and `.`
//! become regular expressions, `#` comments go. Grouping, alternation and
//! the repetitions `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}` are the same in
//! both.

/// Whether `grammar` is written in GBNF (it defines a rule with `::=`).
pub fn is_gbnf(grammar: &str) -> bool {
    grammar.contains("::=")
}

/// A GBNF grammar that cannot be read: where and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("GBNF grammar, byte {offset}: {message}")]
pub struct GbnfError {
    pub offset: usize,
    pub message: String,
}

/// The Lark form of a GBNF grammar.
pub fn to_lark(grammar: &str) -> Result<String, GbnfError> {
    let b = grammar.as_bytes();
    let fail = |offset: usize, message: &str| GbnfError {
        offset,
        message: message.to_string(),
    };
    let mut out = String::with_capacity(grammar.len() + 64);
    let mut i = 0;
    let mut rules = 0;
    while i < b.len() {
        let c = b[i];
        match c {
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' => {
                let (lit, end) = string_literal(grammar, i).map_err(|m| fail(i, &m))?;
                out.push_str(&serde_json::to_string(&lit).expect("a string serialises"));
                i = end;
            }
            b'[' => {
                let end = class_end(b, i).ok_or_else(|| fail(i, "unterminated character class"))?;
                out.push('/');
                out.push_str(&grammar[i..end].replace('/', "\\/"));
                out.push('/');
                i = end;
            }
            b'.' => {
                out.push_str("/(?s:.)/");
                i += 1;
            }
            b':' if grammar[i..].starts_with("::=") => {
                out.truncate(out.trim_end_matches([' ', '\t']).len());
                out.push(':');
                rules += 1;
                i += 3;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'-' || b[i] == b'_')
                {
                    i += 1;
                }
                let name = &grammar[start..i];
                // A rule definition starts a line in Lark.
                let rest = grammar[i..].trim_start_matches([' ', '\t']);
                if rest.starts_with("::=")
                    && !out.trim_end_matches([' ', '\t']).ends_with('\n')
                    && !out.trim().is_empty()
                {
                    out.push('\n');
                }
                out.push_str(&rule_name(name));
            }
            b'\n' => {
                // A rule's body may go on over several lines in GBNF; in
                // Lark a new line ends it unless the next one continues
                // it, so lines are joined and only definitions break them.
                out.push(' ');
                i += 1;
            }
            b'|' | b'(' | b')' | b'*' | b'+' | b'?' | b' ' | b'\t' | b'\r' | b'{' | b'}' | b',' => {
                out.push(c as char);
                i += 1;
            }
            c if c.is_ascii_digit() => {
                out.push(c as char);
                i += 1;
            }
            _ => {
                let ch = grammar[i..].chars().next().unwrap_or('?');
                return Err(fail(i, &format!("unexpected {ch:?}")));
            }
        }
    }
    if rules == 0 {
        return Err(fail(0, "no rule (name ::= ...) defined"));
    }
    if !grammar_defines_root(grammar) {
        return Err(fail(0, "no root rule (root ::= ...)"));
    }
    Ok(out.trim().to_string() + "\n")
}

fn grammar_defines_root(grammar: &str) -> bool {
    grammar.lines().any(|l| {
        let l = l.trim_start();
        l.strip_prefix("root")
            .is_some_and(|r| r.trim_start().starts_with("::="))
    })
}

/// `root` is Lark's `start`; other names lower-cased, `-` as `_`.
fn rule_name(name: &str) -> String {
    if name == "root" {
        return "start".to_string();
    }
    name.to_ascii_lowercase().replace('-', "_")
}

/// Reads the string literal opening at byte `at`: its text and the byte
/// after its closing quote. GBNF escapes: `\n \r \t \\ \" \[ \] \xHH
/// \uHHHH \UHHHHHHHH`.
fn string_literal(g: &str, at: usize) -> Result<(String, usize), String> {
    let mut out = String::new();
    let mut chars = g[at + 1..].char_indices();
    while let Some((k, c)) = chars.next() {
        match c {
            '"' => return Ok((out, at + 1 + k + 1)),
            '\\' => {
                let (_, e) = chars.next().ok_or("unterminated escape")?;
                let hex =
                    |n: usize, chars: &mut std::str::CharIndices<'_>| -> Result<char, String> {
                        let digits: String = chars.by_ref().take(n).map(|(_, c)| c).collect();
                        u32::from_str_radix(&digits, 16)
                            .ok()
                            .and_then(char::from_u32)
                            .ok_or_else(|| format!("bad escape \\{e}{digits}"))
                    };
                out.push(match e {
                    'n' => '\n',
                    'r' => '\r',
                    't' => '\t',
                    'x' => hex(2, &mut chars)?,
                    'u' => hex(4, &mut chars)?,
                    'U' => hex(8, &mut chars)?,
                    other => other,
                });
            }
            c => out.push(c),
        }
    }
    Err("unterminated string".to_string())
}

/// The byte after the `]` closing the class that opens at `at`.
fn class_end(b: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b']' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_strings_classes_and_comments_are_rewritten() {
        let g = "# a list\nroot ::= item (\", \" item)*\nitem ::= [a-z/]+ | \"\\\"q\\\"\" | digit-run\ndigit-run ::=\n   [0-9]{1,3} .?\n";
        let lark = to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: item (\", \" item)* \nitem: /[a-z\\/]/+ | \"\\\"q\\\"\" | digit_run \ndigit_run:    /[0-9]/{1,3} /(?s:.)/?\n"
        );
    }

    #[test]
    fn broken_grammars_are_refused_with_where() {
        assert!(is_gbnf("root ::= \"a\""));
        assert!(!is_gbnf("start: \"a\""));
        let e = to_lark("root ::= \"abc").unwrap_err();
        assert_eq!(e.offset, 9);
        assert!(to_lark("root ::= [abc")
            .unwrap_err()
            .message
            .contains("character class"));
        assert!(to_lark("item ::= \"a\"")
            .unwrap_err()
            .message
            .contains("root"));
        assert!(to_lark("root ::= \"a\" ; x")
            .unwrap_err()
            .message
            .contains("';'"));
    }
}
