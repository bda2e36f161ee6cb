//! The QingNiao IDL (§3.1): proto-like messages, flat fields of int32, int64, string and bytes,
//! and a `dispatch` mark on the fields that dispatch rules may read.
//!
//! ```text
//! // comments run to the end of the line
//! app kv = 1;                      // app_id in the QNP header
//! message Get = 0 {                // req_type in the QNP header
//!     dispatch string key = 0;     // TLV type byte 0; rules may read it
//!     int32 flags = 1;
//! }
//! ```
//!
//! [`compile`] turns a file into Rust source that implements [`crate::QnpMessage`].

use crate::QnpError;
use std::fmt::Write as _;

/// A field type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldType {
    Int32,
    Int64,
    String,
    Bytes,
}

impl FieldType {
    fn rust(self) -> &'static str {
        match self {
            FieldType::Int32 => "i32",
            FieldType::Int64 => "i64",
            FieldType::String => "String",
            FieldType::Bytes => "Vec<u8>",
        }
    }
}

/// One field of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    pub ty: FieldType,
    /// The TLV type byte and the field index dispatch rules refer to.
    pub index: u8,
    pub dispatch: bool,
    pub line: usize,
}

/// One message (request type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub name: String,
    pub req_type: u8,
    pub fields: Vec<Field>,
    pub line: usize,
}

impl Message {
    /// Fields in wire order: dispatch fields first (they must reach the first packet, §3.2.1),
    /// then the rest, each group in declaration order.
    pub fn wire_order(&self) -> impl Iterator<Item = &Field> {
        let dispatch = self.fields.iter().filter(|f| f.dispatch);
        let rest = self.fields.iter().filter(|f| !f.dispatch);
        dispatch.chain(rest)
    }
}

/// A parsed IDL file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema {
    pub app_name: String,
    pub app_id: u8,
    pub messages: Vec<Message>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Number(u64),
    Punct(char),
}

struct Lexer<'a> {
    file: &'a str,
    toks: Vec<(Tok, usize, usize)>,
    pos: usize,
    eof_line: usize,
}

const KEYWORDS: &[&str] = &[
    "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern",
    "false", "fn", "for", "gen", "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut",
    "pub", "ref", "return", "self", "Self", "static", "struct", "super", "trait", "true", "type",
    "unsafe", "use", "where", "while", "abstract", "become", "box", "do", "final", "macro",
    "override", "priv", "typeof", "unsized", "virtual", "yield", "try",
];

impl<'a> Lexer<'a> {
    fn new(file: &'a str, src: &str) -> Result<Self, QnpError> {
        let mut toks = Vec::new();
        let mut line_no = 0;
        for (i, line) in src.lines().enumerate() {
            line_no = i + 1;
            let code = line.split("//").next().unwrap_or("");
            let bytes: Vec<(usize, char)> = code.char_indices().collect();
            let mut j = 0;
            while j < bytes.len() {
                let (col, c) = bytes[j];
                let col = col + 1;
                if c.is_whitespace() {
                    j += 1;
                } else if c.is_ascii_alphabetic() || c == '_' {
                    let start = j;
                    while j < bytes.len()
                        && (bytes[j].1.is_ascii_alphanumeric() || bytes[j].1 == '_')
                    {
                        j += 1;
                    }
                    let s: String = bytes[start..j].iter().map(|(_, c)| c).collect();
                    toks.push((Tok::Ident(s), line_no, col));
                } else if c.is_ascii_digit() {
                    let start = j;
                    while j < bytes.len() && bytes[j].1.is_ascii_alphanumeric() {
                        j += 1;
                    }
                    let s: String = bytes[start..j].iter().map(|(_, c)| c).collect();
                    let n = s.parse::<u64>().map_err(|_| QnpError::Idl {
                        file: file.to_owned(),
                        line: line_no,
                        col,
                        msg: format!("`{s}` is not a decimal number; write numbers like 0, 1, 255"),
                    })?;
                    toks.push((Tok::Number(n), line_no, col));
                } else if "{}=;".contains(c) {
                    toks.push((Tok::Punct(c), line_no, col));
                    j += 1;
                } else {
                    return Err(QnpError::Idl {
                        file: file.to_owned(),
                        line: line_no,
                        col,
                        msg: format!("unexpected character `{c}`; the IDL uses identifiers, numbers, `{{ }} = ;` and `//` comments"),
                    });
                }
            }
        }
        Ok(Lexer {
            file,
            toks,
            pos: 0,
            eof_line: line_no.max(1),
        })
    }

    fn err_here(&self, msg: String) -> QnpError {
        let (line, col) = match self.toks.get(self.pos) {
            Some((_, l, c)) => (*l, *c),
            None => (self.eof_line, 1),
        };
        QnpError::Idl {
            file: self.file.to_owned(),
            line,
            col,
            msg,
        }
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|(t, _, _)| t)
    }

    fn line(&self) -> usize {
        self.toks
            .get(self.pos)
            .map_or(self.eof_line, |(_, l, _)| *l)
    }

    fn describe(&self) -> String {
        match self.peek() {
            None => "end of file".to_owned(),
            Some(Tok::Ident(s)) => format!("`{s}`"),
            Some(Tok::Number(n)) => format!("`{n}`"),
            Some(Tok::Punct(c)) => format!("`{c}`"),
        }
    }

    fn ident(&mut self, what: &str) -> Result<String, QnpError> {
        if let Some(Tok::Ident(s)) = self.peek() {
            let s = s.clone();
            self.pos += 1;
            return Ok(s);
        }
        Err(self.err_here(format!("expected {what}, found {}", self.describe())))
    }

    fn punct(&mut self, c: char) -> Result<(), QnpError> {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.pos += 1;
            return Ok(());
        }
        Err(self.err_here(format!("expected `{c}`, found {}", self.describe())))
    }

    fn byte(&mut self, what: &str) -> Result<u8, QnpError> {
        if let Some(Tok::Number(n)) = self.peek() {
            let n = *n;
            let v = u8::try_from(n).map_err(|_| {
                self.err_here(format!("{what} {n} does not fit in a byte; use 0..=255"))
            })?;
            self.pos += 1;
            return Ok(v);
        }
        Err(self.err_here(format!(
            "expected {what} (0..=255), found {}",
            self.describe()
        )))
    }
}

/// Parses and validates an IDL file. `file` names it in error messages.
pub fn parse(file: &str, src: &str) -> Result<Schema, QnpError> {
    let mut lx = Lexer::new(file, src)?;
    let kw = lx.ident("`app NAME = ID;`")?;
    if kw != "app" {
        lx.pos -= 1;
        return Err(lx.err_here(format!("a file starts with `app NAME = ID;`, found `{kw}`")));
    }
    let app_at = lx.pos;
    let app_name = lx.ident("the application name")?;
    if KEYWORDS.contains(&app_name.as_str())
        || app_name.starts_with(|c: char| c.is_ascii_uppercase())
    {
        lx.pos = app_at;
        return Err(lx.err_here(format!(
            "application name `{app_name}` cannot name a Rust module (`{app_name}.rs`); use a snake_case name that is not a Rust keyword"
        )));
    }
    lx.punct('=')?;
    let app_id = lx.byte("app id")?;
    lx.punct(';')?;
    let mut messages: Vec<Message> = Vec::new();
    while lx.peek().is_some() {
        let line = lx.line();
        let kw = lx.ident("`message`")?;
        if kw != "message" {
            lx.pos -= 1;
            return Err(lx.err_here(format!(
                "expected `message NAME = REQ_TYPE {{`, found `{kw}`"
            )));
        }
        lx.pos -= 1;
        let name_at = lx.pos + 1;
        lx.pos += 1;
        let name = lx.ident("the message name")?;
        check_type_name(&lx, name_at, &name)?;
        if messages.iter().any(|m| m.name == name) {
            lx.pos = name_at;
            return Err(lx.err_here(format!("message `{name}` is defined twice; rename one")));
        }
        lx.punct('=')?;
        let rt_at = lx.pos;
        let req_type = lx.byte("request type")?;
        if let Some(other) = messages.iter().find(|m| m.req_type == req_type) {
            lx.pos = rt_at;
            return Err(lx.err_here(format!(
                "request type {req_type} is already used by `{}`; give each message its own number",
                other.name
            )));
        }
        lx.punct('{')?;
        let mut fields: Vec<Field> = Vec::new();
        while lx.peek() != Some(&Tok::Punct('}')) {
            let line = lx.line();
            let mut word = lx.ident("a field (`[dispatch] TYPE NAME = INDEX;`) or `}`")?;
            let dispatch = word == "dispatch";
            if dispatch {
                word = lx.ident("the field type")?;
            }
            let ty = match word.as_str() {
                "int32" => FieldType::Int32,
                "int64" => FieldType::Int64,
                "string" => FieldType::String,
                "bytes" => FieldType::Bytes,
                other => {
                    lx.pos -= 1;
                    return Err(lx.err_here(format!(
                        "unknown field type `{other}`; use int32, int64, string or bytes (nested messages are not supported)"
                    )));
                }
            };
            let fname_at = lx.pos;
            let fname = lx.ident("the field name")?;
            if fname.starts_with(|c: char| c.is_ascii_uppercase())
                || KEYWORDS.contains(&fname.as_str())
            {
                lx.pos = fname_at;
                return Err(lx.err_here(format!(
                    "field name `{fname}` cannot be a Rust field; use a snake_case name that is not a Rust keyword"
                )));
            }
            if fields.iter().any(|f| f.name == fname) {
                lx.pos = fname_at;
                return Err(lx.err_here(format!(
                    "field `{fname}` is declared twice in `{name}`; rename one"
                )));
            }
            lx.punct('=')?;
            let idx_at = lx.pos;
            let index = lx.byte("field index")?;
            if let Some(f) = fields.iter().find(|f| f.index == index) {
                lx.pos = idx_at;
                return Err(lx.err_here(format!(
                    "field index {index} is already used by `{}`; each field needs its own index",
                    f.name
                )));
            }
            lx.punct(';')?;
            fields.push(Field {
                name: fname,
                ty,
                index,
                dispatch,
                line,
            });
        }
        lx.punct('}')?;
        messages.push(Message {
            name,
            req_type,
            fields,
            line,
        });
    }
    Ok(Schema {
        app_name,
        app_id,
        messages,
    })
}

/// Names the generated module uses itself (imports, the app id constant).
const RESERVED_TYPES: &[&str] = &["QnpError", "QnpMessage", "APP_ID"];

fn check_type_name(lx: &Lexer<'_>, at: usize, name: &str) -> Result<(), QnpError> {
    if RESERVED_TYPES.contains(&name) {
        let here = Lexer {
            file: lx.file,
            toks: lx.toks.clone(),
            pos: at,
            eof_line: lx.eof_line,
        };
        return Err(here.err_here(format!(
            "message name `{name}` is taken by the generated code; rename the message"
        )));
    }
    if name.starts_with(|c: char| c.is_ascii_uppercase()) && !KEYWORDS.contains(&name) {
        return Ok(());
    }
    let here = Lexer {
        file: lx.file,
        toks: lx.toks.clone(),
        pos: at,
        eof_line: lx.eof_line,
    };
    Err(here.err_here(format!(
        "message name `{name}` must start with an upper-case letter (it becomes a Rust struct)"
    )))
}

/// Generates the Rust module for a schema. `source_name` is recorded in the header comment.
pub fn generate(schema: &Schema, source_name: &str) -> String {
    let mut o = String::new();
    // `write!` into a String cannot fail; the results are ignored on purpose.
    let _ = writeln!(
        o,
        "// @generated by `flatmesh qnp idl compile` from {source_name}. Do not edit.\n\
         //! QNP messages of application `{}` (app_id {}).\n\n\
         use flatmesh_qnp::tlv;\n\
         use flatmesh_qnp::{{QnpError, QnpMessage}};\n\n\
         /// The QNP `app_id` of this application.\n\
         pub const APP_ID: u8 = {};",
        schema.app_name, schema.app_id, schema.app_id
    );
    for m in &schema.messages {
        let _ = writeln!(
            o,
            "\n/// Request type {} of `{}`.\n#[derive(Debug, Clone, PartialEq, Eq, Default)]\npub struct {} {{",
            m.req_type, schema.app_name, m.name
        );
        for f in &m.fields {
            let mark = if f.dispatch { " (dispatch)" } else { "" };
            let _ = writeln!(
                o,
                "    /// Field {}{mark}.\n    pub {}: {},",
                f.index,
                f.name,
                f.ty.rust()
            );
        }
        let _ = writeln!(o, "}}\n\nimpl QnpMessage for {} {{", m.name);
        let _ = writeln!(
            o,
            "    const APP_ID: u8 = APP_ID;\n    const REQ_TYPE: u8 = {};\n",
            m.req_type
        );
        let _ = writeln!(
            o,
            "    fn encode(&self, out: &mut Vec<u8>) -> Result<usize, QnpError> {{\n        let start = out.len();"
        );
        let mut ended_dispatch = false;
        for f in m.wire_order() {
            if !f.dispatch && !ended_dispatch {
                let _ = writeln!(o, "        let dispatch_len = out.len() - start;");
                ended_dispatch = true;
            }
            let _ = match f.ty {
                FieldType::Int32 => writeln!(
                    o,
                    "        tlv::put_i32(out, {}, self.{});",
                    f.index, f.name
                ),
                FieldType::Int64 => writeln!(
                    o,
                    "        tlv::put_i64(out, {}, self.{});",
                    f.index, f.name
                ),
                FieldType::String => writeln!(
                    o,
                    "        tlv::put_string(out, {}, &self.{})?;",
                    f.index, f.name
                ),
                FieldType::Bytes => writeln!(
                    o,
                    "        tlv::put_bytes(out, {}, &self.{})?;",
                    f.index, f.name
                ),
            };
        }
        if !ended_dispatch {
            let _ = writeln!(o, "        let dispatch_len = out.len() - start;");
        }
        let _ = writeln!(o, "        Ok(dispatch_len)\n    }}\n");
        let n = m.fields.len();
        let _ = writeln!(o, "    fn decode(buf: &[u8]) -> Result<Self, QnpError> {{");
        if n == 0 {
            let _ = writeln!(
                o,
                "        for field in tlv::TlvReader::new(buf) {{\n            field?;\n        }}\n        Ok(Self::default())\n    }}\n}}"
            );
            continue;
        }
        let _ = writeln!(
            o,
            "        let mut msg = Self::default();\n        let mut seen = [false; {n}];\n        for field in tlv::TlvReader::new(buf) {{\n            let field = field?;\n            match field.field {{"
        );
        for (i, f) in m.fields.iter().enumerate() {
            let get = match f.ty {
                FieldType::Int32 => "tlv::get_i32(&field)?",
                FieldType::Int64 => "tlv::get_i64(&field)?",
                FieldType::String => "tlv::get_string(&field)?",
                FieldType::Bytes => "tlv::get_bytes(&field)",
            };
            let _ = writeln!(
                o,
                "                {} => {{\n                    tlv::mark_seen(&mut seen[{i}], &field)?;\n                    msg.{} = {get};\n                }}",
                f.index, f.name
            );
        }
        let _ = writeln!(
            o,
            "                // Unknown fields are skipped so old readers accept newer writers.\n                _ => {{}}\n            }}\n        }}\n        Ok(msg)\n    }}\n}}"
        );
    }
    o
}

/// Parses `src` and generates Rust. The output file name is `<app name>.rs`.
pub fn compile(file: &str, src: &str) -> Result<(String, String), QnpError> {
    let schema = parse(file, src)?;
    let name = std::path::Path::new(file)
        .file_name()
        .map_or_else(|| file.to_owned(), |n| n.to_string_lossy().into_owned());
    Ok((format!("{}.rs", schema.app_name), generate(&schema, &name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KV: &str = "app kv = 1;\nmessage Get = 0 {\n  int32 flags = 1;\n  dispatch string key = 0; // rules read this\n}\nmessage Put = 1 { dispatch string key = 0; bytes value = 2; int64 ttl = 3; }\n";

    #[test]
    fn parses_a_schema() {
        let s = parse("kv.qnp", KV).unwrap();
        assert_eq!(s.app_id, 1);
        assert_eq!(s.messages.len(), 2);
        let get = &s.messages[0];
        assert_eq!(get.req_type, 0);
        let order: Vec<_> = get.wire_order().map(|f| f.name.as_str()).collect();
        assert_eq!(order, ["key", "flags"], "dispatch fields go first");
        assert_eq!(s.messages[1].fields[1].ty, FieldType::Bytes);
    }

    fn err_of(src: &str) -> String {
        parse("x.qnp", src).unwrap_err().to_string()
    }

    #[test]
    fn errors_point_at_file_line_col_and_say_what_to_do() {
        let e = err_of("app kv = 1;\nmessage Get = 0 {\n  float x = 1;\n}\n");
        assert!(
            e.starts_with("x.qnp:3:3: unknown field type `float`"),
            "{e}"
        );
        let e = err_of("app kv = 1;\nmessage Get = 0 { int32 a = 1; int32 b = 1; }");
        assert!(
            e.starts_with("x.qnp:2:42: field index 1 is already used by `a`"),
            "{e}"
        );
        let e = err_of("app kv = 300;");
        assert!(e.contains("does not fit in a byte"), "{e}");
        let e = err_of("app kv = 1;\nmessage Get = 0 { int32 a = 1; }\nmessage Put = 0 {}");
        assert!(
            e.starts_with("x.qnp:3:15: request type 0 is already used by `Get`"),
            "{e}"
        );
        let e = err_of("app kv = 1;\nmessage Get = 0 { int32 type = 1; }");
        assert!(e.contains("Rust keyword"), "{e}");
        let e = err_of("app kv = 1;\nmessage get = 0 {}");
        assert!(e.contains("upper-case"), "{e}");
        let e = err_of("app kv = 1;\nmessage Get = 0 {");
        assert!(e.contains("end of file"), "{e}");
        let e = err_of("");
        assert!(e.starts_with("x.qnp:1:1:"), "{e}");
        let e = err_of("app kv = 1;\nmessage QnpError = 0 {}");
        assert!(
            e.starts_with("x.qnp:2:9: message name `QnpError` is taken"),
            "{e}"
        );
        let e = err_of("app mod = 1;");
        assert!(e.starts_with("x.qnp:1:5: application name `mod`"), "{e}");
        let e = err_of("app kv = 1; $");
        assert!(e.contains("unexpected character `$`"), "{e}");
    }

    #[test]
    fn generated_code_is_deterministic_and_names_the_source() {
        let (name, a) = compile("dir/kv.qnp", KV).unwrap();
        let (_, b) = compile("dir/kv.qnp", KV).unwrap();
        assert_eq!(name, "kv.rs");
        assert_eq!(a, b);
        assert!(a.contains("from kv.qnp"));
        assert!(a.contains("pub struct Get"));
        assert!(a.contains("const REQ_TYPE: u8 = 1;"));
    }
}
