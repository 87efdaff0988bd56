package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strings"
)

// isTerminal reports whether r is an interactive terminal. A variable so
// tests can pretend.
var isTerminal = func(r io.Reader) bool {
	f, ok := r.(*os.File)
	return ok && fileIsTerminal(f)
}

// stdoutIsTerminal reports whether w is a terminal, where stats --watch
// redraws the screen. A variable so tests can pretend.
var stdoutIsTerminal = func(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && fileIsTerminal(f)
}

// confirm asks question on stderr when stdin is a terminal and yes is
// false. It returns a *refusedError when the answer is not yes, or when
// stdin is not a terminal and yes is false.
func (c *cli) confirm(cmdName, question string, yes bool) error {
	if yes {
		return nil
	}
	if !isTerminal(c.stdin) {
		return &refusedError{msg: fmt.Sprintf("%s changes data and stdin is not a terminal to confirm it; pass --yes to run it without asking", cmdName)}
	}
	fmt.Fprintf(c.stderr, "%s [y/N] ", question)
	line, err := bufio.NewReader(c.stdin).ReadString('\n')
	if err != nil && line == "" {
		return &refusedError{msg: "no answer; nothing was changed (pass --yes to skip the question)"}
	}
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		return nil
	}
	return &refusedError{msg: "not confirmed; nothing was changed"}
}
