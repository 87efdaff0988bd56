package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// writeJSON writes v as one indented JSON document.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// newTable returns a tabwriter for aligned columns.
func newTable(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
}

// jsonPayload holds a payload as text when it is valid UTF-8, else as
// base64.
type jsonPayload struct {
	Payload       *string `json:"payload,omitempty"`
	PayloadBase64 []byte  `json:"payload_base64,omitempty"`
}

func payloadJSON(p []byte) jsonPayload {
	if utf8.Valid(p) {
		s := string(p)
		return jsonPayload{Payload: &s}
	}
	return jsonPayload{PayloadBase64: p}
}

// metadataMap returns md as a map that encodes as {} when empty.
func metadataMap(md message.Metadata) map[string]string {
	if md == nil {
		return map[string]string{}
	}
	return md
}

// short cuts s to n runes on one line.
func short(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}

// groupName shows the default group as "(default)", and a name that
// would not read as itself unquoted (see plainOrQuoted) quoted.
func groupName(g string) string {
	switch g {
	case "":
		return "(default)"
	case "(default)":
		return strconv.Quote(g) // a group of that name is not the default one
	}
	return plainOrQuoted(g)
}

// plainOrQuoted returns s as it is when it reads as itself between
// spaces, and Go-quoted when it would not: a name with spaces (" ops team "
// and "ops team" printed bare look alike), quotes, characters that do not
// print, or bytes that are not UTF-8.
func plainOrQuoted(s string) string {
	for _, r := range s {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) || r == '"' || r == utf8.RuneError {
			return strconv.Quote(s)
		}
	}
	return s
}

// age formats a duration for tables: "-" for zero.
func age(d time.Duration) string {
	if d <= 0 {
		return "-"
	}
	if d >= time.Second {
		d = d.Round(time.Second)
	} else {
		d = d.Round(time.Millisecond)
	}
	return d.String()
}

// printPayload writes a payload for a human: text as is, binary as a note.
func printPayload(w io.Writer, p []byte) {
	if utf8.Valid(p) {
		fmt.Fprintf(w, "%s\n", p)
		return
	}
	fmt.Fprintf(w, "(%d bytes of binary; use --json for base64)\n", len(p))
}

// readAll reads r to the end.
func readAll(r io.Reader) ([]byte, error) { return io.ReadAll(r) }
