// Package errtext builds error texts that name "pgoutbox:" once, however
// many pgoutbox errors they wrap.
package errtext

import (
	"fmt"
	"strings"
)

// Prefix begins every pgoutbox error text.
const Prefix = "pgoutbox: "

// Errorf is fmt.Errorf (errors.Is and errors.As see every %w) whose text
// drops the Prefix of each wrapped error after the first one:
// "pgoutbox: invalid message: payload too large: …", not "pgoutbox: invalid
// message: pgoutbox: payload too large: …".
func Errorf(format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	msg := err.Error()
	start := strings.Index(msg, Prefix)
	if start < 0 {
		return err
	}
	head, tail := msg[:start+len(Prefix)], msg[start+len(Prefix):]
	if !strings.Contains(tail, ": "+Prefix) {
		return err
	}
	return &wrapped{msg: head + strings.ReplaceAll(tail, ": "+Prefix, ": "), err: err}
}

// Trim returns err's text without its Prefix, for a caller that prints its
// own (the CLI).
func Trim(err error) string { return strings.TrimPrefix(err.Error(), Prefix) }

type wrapped struct {
	msg string
	err error
}

func (w *wrapped) Error() string { return w.msg }

// Unwrap returns what fmt.Errorf built, whose own Unwrap gives the wrapped
// errors.
func (w *wrapped) Unwrap() error { return w.err }
