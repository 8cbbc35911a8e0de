//! Chat templates (Jinja, from GGUF metadata or tokenizer_config.json).
//!
//! Templates are rendered with minijinja configured the way Hugging Face
//! renders them: `trim_blocks` and `lstrip_blocks` on, Python string methods
//! (`.strip()`, `.startswith()`, ...) available, and a `raise_exception`
//! function that turns into a render error. The variables are `messages`
//! (each with `role` and `content`, and `tool_calls`, `tool_call_id` and
//! `name` where a message has them), `add_generation_prompt`, `bos_token`
//! and `eos_token`, plus the caller's extra variables (a request's `tools`,
//! its `chat_template_kwargs`).

use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's calls, in OpenAI's shape (templates that know tools
    /// render them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool's answer: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool's answer: the tool's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub fn new(source: String, bos_token: String, eos_token: String) -> ChatTemplate {
        ChatTemplate {
            source,
            bos_token,
            eos_token,
        }
    }

    /// The Jinja source of the template.
    pub fn source(&self) -> &str {
        &self.source
    }

    fn environment(&self) -> Environment<'_> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env
    }

    /// Checks that the template compiles.
    pub fn validate(&self) -> anyhow::Result<()> {
        let env = self.environment();
        env.template_from_str(&self.source)
            .map_err(|e| anyhow::anyhow!("chat template does not compile: {e:#}"))?;
        Ok(())
    }

    /// Renders the conversation to the prompt text.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> anyhow::Result<String> {
        let ending = if add_generation_prompt {
            Ending::NextTurn
        } else {
            Ending::Closed
        };
        self.render_ending(messages, ending, &serde_json::Map::new())
    }

    /// Renders the conversation ending as `ending` says, with extra template
    /// variables (a request's `chat_template_kwargs`, e.g.
    /// `enable_thinking`; the conversation, `add_generation_prompt` and the
    /// special tokens win over a variable of the same name). To continue
    /// the last message, the conversation is rendered closed and cut right
    /// after the last occurrence of that message's text (or of its text
    /// trimmed, for templates that trim messages), as Hugging Face's
    /// `continue_final_message` does; a rendering without that text is an
    /// error.
    pub fn render_ending(
        &self,
        messages: &[ChatMessage],
        ending: Ending,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> anyhow::Result<String> {
        let env = self.environment();
        let tmpl = env
            .template_from_str(&self.source)
            .map_err(|e| anyhow::anyhow!("chat template does not compile: {e:#}"))?;
        let extra = minijinja::Value::from_serialize(kwargs);
        let text = tmpl
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => ending == Ending::NextTurn,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                ..extra
            })
            .map_err(|e| anyhow::anyhow!("chat template failed to render: {e:#}"))?;
        if ending != Ending::ContinueLast {
            return Ok(text);
        }
        let last = messages
            .last()
            .map(|m| m.content.as_str())
            .ok_or_else(|| anyhow::anyhow!("there is no message to continue"))?;
        anyhow::ensure!(
            !last.trim().is_empty(),
            "the last message has no text to continue"
        );
        let end = [last, last.trim()]
            .iter()
            .find_map(|t| text.rfind(t).map(|at| at + t.len()))
            .ok_or_else(|| {
                anyhow::anyhow!("the template's rendering does not hold the last message's text")
            })?;
        Ok(text[..end].to_string())
    }
}

/// How a conversation's rendering ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// After the last message, as the template closes it.
    Closed,
    /// With the assistant's turn opening (`add_generation_prompt`).
    NextTurn,
    /// Inside the last message, right after its text, so that the model
    /// continues it (vLLM's `continue_final_message`).
    ContinueLast,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    #[test]
    fn renders_with_python_methods_and_block_trimming() {
        let src = "{% for m in messages %}\n  {{ bos_token }}{{ m.role | upper }}: {{ m.content.strip() }}{{ eos_token }}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}";
        let t = ChatTemplate::new(src.into(), "<s>".into(), "</s>".into());
        let out = t
            .render(&[msg("user", "  hi  "), msg("assistant", "yo")], true)
            .unwrap();
        // As Python jinja2 with trim_blocks and lstrip_blocks renders it: block
        // lines vanish, indentation before `{{` stays.
        assert_eq!(out, "  <s>USER: hi</s>\n  <s>ASSISTANT: yo</s>\nA:");
        let out = t.render(&[msg("user", "x")], false).unwrap();
        assert_eq!(out, "  <s>USER: x</s>\n");
    }

    #[test]
    fn a_rendering_continuing_the_last_message_ends_after_its_text() {
        let src = "{% for m in messages %}<{{ m.role }}>{{ m.content.strip() }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        let t = ChatTemplate::new(src.into(), "<s>".into(), "</s>".into());
        let none = serde_json::Map::new();
        let conv = [msg("user", "Name a colour."), msg("assistant", "It is ")];
        let render = |e| t.render_ending(&conv, e, &none).unwrap();
        assert_eq!(
            render(Ending::Closed),
            "<user>Name a colour.</user><assistant>It is</assistant>"
        );
        assert_eq!(
            render(Ending::NextTurn),
            "<user>Name a colour.</user><assistant>It is</assistant><assistant>"
        );
        // The template trims "It is ": cut after the trimmed text.
        assert_eq!(
            render(Ending::ContinueLast),
            "<user>Name a colour.</user><assistant>It is"
        );
        let empty = [msg("user", "x"), msg("assistant", " ")];
        assert!(t
            .render_ending(&empty, Ending::ContinueLast, &none)
            .is_err());
        let hidden = ChatTemplate::new("{{ messages | length }}".into(), "".into(), "".into());
        assert!(hidden
            .render_ending(&conv, Ending::ContinueLast, &none)
            .is_err());
    }

    #[test]
    fn raise_exception_is_an_error() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let t = ChatTemplate::new(src.into(), String::new(), String::new());
        assert_eq!(t.render(&[msg("user", "a")], false).unwrap(), "ok");
        let err = t.render(&[msg("system", "a")], false).unwrap_err();
        assert!(format!("{err:#}").contains("first must be user"), "{err:#}");
    }

    #[test]
    fn bad_template_is_refused() {
        let t = ChatTemplate::new("{% for %}".into(), String::new(), String::new());
        assert!(t.validate().is_err());
        assert!(t.render(&[], false).is_err());
    }

    /// Tools and calls reach the template as a tool-aware template (Qwen's
    /// and Hermes' shape) reads them.
    #[test]
    fn tools_calls_and_tool_answers_reach_the_template() {
        let src = "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}\
{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}({{ c.function.arguments }})</tool_call>{% endfor %}\
{% elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}{% else %}{{ m.content }}{% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src.into(), String::new(), String::new());
        let call = serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]);
        let msgs = [
            msg("user", "time?"),
            ChatMessage {
                tool_calls: Some(call),
                ..msg("assistant", "")
            },
            ChatMessage {
                tool_call_id: Some("c1".into()),
                ..msg("tool", "14:05")
            },
        ];
        let mut vars = serde_json::Map::new();
        vars.insert(
            "tools".into(),
            serde_json::json!([{"type": "function", "function": {"name": "get_time"}}]),
        );
        let out = t.render_ending(&msgs, Ending::Closed, &vars).unwrap();
        assert_eq!(
            out,
            // trim_blocks eats the newline after each block tag, as in
            // Hugging Face's rendering.
            "TOOLS:get_time;user:time?assistant:<tool_call>get_time({})</tool_call>tool:[c1] 14:05"
        );
    }
}
