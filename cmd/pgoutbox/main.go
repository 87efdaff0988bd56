// Command pgoutbox operates a pgoutbox outbox from a shell: it prints and
// applies the schema, shows queue statistics, lists, requeues, deletes and
// purges dead letters, peeks at pending messages, publishes test messages and
// binds consumer groups.
//
// Install it with:
//
//	go install github.com/pgoutbox/watermill-pgoutbox/cmd/pgoutbox@latest
//
// Usage:
//
//	pgoutbox <command> [flags]
//
//	schema sql|apply|validate   print, create or check the tables
//	schema migrate up|down|status|baseline|files  versioned migrations
//	stats                       messages per topic and group (--watch for a live table), and the tables' health
//	health                      dead tuples, sizes, and the oldest snapshots holding vacuum back
//	dlq list|show|requeue|delete|purge  dead letters
//	peek                        the next messages of a topic and group
//	publish                     publish one message (manual testing)
//	cancel                      cancel a scheduled message by its dedup key
//	bind|unbind                 bind a consumer group to a topic, or unbind it
//	move                        move a group's waiting messages into another group
//	rename                      rename a consumer group of a topic, under traffic
//	pause|resume                stop a consumer group's claims of a topic, or restart them
//	ui                          a web page for operators
//	version                     the version of this build
//
// Every command takes the connection and table flags: --dsn (else
// PGOUTBOX_DSN, else POSTGRES_DSN), --schema (PGOUTBOX_SCHEMA), --table
// (PGOUTBOX_TABLE), --dlq-table (PGOUTBOX_DLQ_TABLE), --no-dlq, --rotating
// and --arrivals, before or after the command. Every read command takes
// --json and then writes one JSON document to stdout.
// "pgoutbox <command> --help" shows a command's flags and examples.
//
// Commands that delete or move messages (dlq requeue, dlq purge, unbind
// --purge, move, rename) ask for confirmation when stdin is a terminal; --yes skips the
// question. Without a terminal they refuse to run unless --yes is given.
//
// Exit codes:
//
//	0  success
//	1  runtime or database error, or nothing to act on (unbind of a group
//	   that is not bound, cancel of a message that is not scheduled, dlq
//	   requeue or delete --id of an id that is not a dead letter)
//	2  usage error (unknown command or flag, missing argument, a value the
//	   outbox refuses such as a topic with a control character)
//	3  refused: a confirmation not given (answered no, or no terminal and no --yes),
//	   or messages a flag must allow to drop (schema migrate down --drop-messages)
//	4  validation found problems (schema validate)
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
)

// Exit codes, as documented in the package doc and in usage.
const (
	exitOK         = 0
	exitError      = 1
	exitUsage      = 2
	exitRefused    = 3
	exitValidation = 4
)

const exitCodesHelp = `Exit codes:
  0  success
  1  runtime or database error, or nothing to act on (unbind of a group
     that is not bound, cancel of a message that is not scheduled, dlq
     requeue or delete --id of an id that is not a dead letter)
  2  usage error (unknown command or flag, missing argument, a value the
     outbox refuses such as a topic with a control character)
  3  refused: a confirmation not given (answered no, or no terminal and no --yes),
     or messages a flag must allow to drop (schema migrate down --drop-messages)
  4  validation found problems (schema validate)
`

const mainUsage = `pgoutbox operates a pgoutbox outbox (a PostgreSQL table used as a Watermill Pub/Sub).

Usage:
  pgoutbox <command> [flags]

Commands:
  schema sql|apply|validate    print the DDL, create the tables, or check them
  schema migrate up|down|...   versioned migrations (status, baseline, files for goose/golang-migrate)
  stats                        messages per topic and consumer group (--watch: live), and the tables' health
  health                       dead tuples, sizes, and the oldest snapshots holding vacuum back
  dlq list|show|requeue|delete|purge  inspect and act on dead letters
  peek                         the next messages a topic and group will deliver
  publish                      publish one message (manual testing)
  cancel                       cancel a scheduled message by its dedup key
  bind | unbind                bind a consumer group to a topic, or unbind it
  move                         move a group's waiting messages into another group
  rename                       rename a consumer group of a topic, under traffic
  pause | resume               stop a consumer group's claims of a topic, or restart them
  ui                           a web page for operators (--listen 127.0.0.1:8080)
  version                      the version of this build

Connection and tables (every command, before or after it):
  --dsn        PostgreSQL DSN (else $PGOUTBOX_DSN, else $POSTGRES_DSN)
  --schema     schema of the tables (else $PGOUTBOX_SCHEMA, default public)
  --table      outbox table (else $PGOUTBOX_TABLE, default outbox)
  --dlq-table  dead-letter table (else $PGOUTBOX_DLQ_TABLE, default <table>_dlq)
  --no-dlq     the outbox has no dead-letter table
  --rotating   the outbox is rotating (else $PGOUTBOX_ROTATING; read from the database when not given)
  --arrivals   the outbox has an arrivals table (else $PGOUTBOX_ARRIVALS; found in the database)

Read commands take --json (before or after the command) and write one JSON document to stdout.
Run "pgoutbox <command> --help" for a command's flags and examples.

Examples:
  export PGOUTBOX_DSN="postgres://app@db:5432/app?sslmode=disable"
  pgoutbox schema validate
  pgoutbox stats --watch
  pgoutbox dlq list --topic orders.placed
  pgoutbox dlq requeue --id 42 --yes

` + exitCodesHelp

// usageError is a mistake in the command line: exit code 2.
type usageError struct {
	cmd string // the command whose --help helps, "" for the top level
	msg string
}

func (e *usageError) Error() string { return e.msg }

func usagef(cmd, format string, args ...any) error {
	return &usageError{cmd: cmd, msg: fmt.Sprintf(format, args...)}
}

// errRefused is a confirmation that was refused: exit code 3.
var errRefused = errors.New("refused")

// refusedError carries the message explaining a refusal.
type refusedError struct{ msg string }

func (e *refusedError) Error() string { return e.msg }
func (e *refusedError) Unwrap() error { return errRefused }

// problemsError reports validation problems: exit code 4. Its message was
// already written.
type problemsError struct{ n int }

func (e *problemsError) Error() string { return fmt.Sprintf("%d problem(s) found", e.n) }

// cli holds a run's streams.
type cli struct {
	stdin          io.Reader
	stdout, stderr io.Writer
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// run runs the command line args (without the program name) and returns
// the exit code.
func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	c := &cli{stdin: stdin, stdout: stdout, stderr: stderr}
	err := c.dispatch(args)
	var ue *usageError
	var pe *problemsError
	var re *refusedError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errHelp):
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "pgoutbox: %s\n", once(ue.msg))
		if ue.cmd != "" {
			fmt.Fprintf(stderr, "Run \"pgoutbox %s --help\" for usage.\n", ue.cmd)
		} else {
			fmt.Fprintln(stderr, "Run \"pgoutbox --help\" for usage.")
		}
		return exitUsage
	case errors.As(err, &re):
		fmt.Fprintf(stderr, "pgoutbox: %s\n", once(re.msg))
		return exitRefused
	case errors.As(err, &pe):
		return exitValidation
	case badInput(err):
		fmt.Fprintf(stderr, "pgoutbox: %s%s\n", errorText(err), hint(err))
		return exitUsage
	default:
		fmt.Fprintf(stderr, "pgoutbox: %s%s\n", errorText(err), hint(err))
		return exitError
	}
}

// errorText is err's text for "pgoutbox: " to begin: without the prefix,
// and without the prefix of every error it wraps, so that it reads once.
func errorText(err error) string { return once(errtext.Trim(err)) }

// once drops the "pgoutbox: " a wrapped error repeats after a context
// ("migrate: pgoutbox: …" reads "migrate: …").
func once(msg string) string {
	return strings.ReplaceAll(strings.TrimPrefix(msg, errtext.Prefix), ": "+errtext.Prefix, ": ")
}

// contextError puts what the command was doing in front of an error
// whose own context would mislead (the "stats:" of a Stats call that
// bind makes): msg replaces err's text; errors.Is and As see err.
type contextError struct {
	msg string
	err error
}

func (e *contextError) Error() string { return e.msg }
func (e *contextError) Unwrap() error { return e.err }

// doing returns err with the context what in front, and without the
// leading context drop ("stats: ") of the library's text.
func doing(what string, err error, drop string) error {
	if err == nil {
		return nil
	}
	return &contextError{msg: what + ": " + strings.TrimPrefix(errorText(err), drop), err: err}
}

// hintedError carries the hint for an error whose cause the command found
// out (a missing dead-letter table): run prints it instead of hint's.
type hintedError struct {
	err  error
	hint string
}

func (e *hintedError) Error() string { return e.err.Error() }
func (e *hintedError) Unwrap() error { return e.err }

// schemaPrivilegeHint gives a schema command's missing privilege its own
// advice: the application roles' grants (docs/operations.md) are not what
// schema commands need; the role that owns the outbox is.
func schemaPrivilegeHint(err error) error {
	var pgErr *pgconn.PgError
	var he *hintedError
	if errors.As(err, &pgErr) && pgErr.Code == insufficientPrivilege && !errors.As(err, &he) {
		return &hintedError{err: err, hint: "; schema commands create, change and read the outbox's tables and their version: run them as the " +
			"migration role that owns the outbox (or its schema), not as a publisher or subscriber role (docs/operations.md, Least privilege)"}
	}
	return err
}

// badInput reports whether err is the library refusing a value given on
// the command line (a topic, a group, a table name): a usage error.
func badInput(err error) bool {
	for _, e := range []error{pgoutbox.ErrInvalidTopic, pgoutbox.ErrInvalidGroup, pgoutbox.ErrInvalidMessage, pgoutbox.ErrInvalidConfig, schema.ErrInvalidName} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// hint adds what to do to a database error whose cause the CLI knows.
func hint(err error) string {
	var he *hintedError
	if errors.As(err, &he) {
		return he.hint
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == undefinedTable && !strings.Contains(err.Error(), "schema.Create") {
		return "; run \"pgoutbox schema apply\" to create the tables, or check --schema and --table (or PGOUTBOX_SCHEMA, PGOUTBOX_TABLE)"
	}
	if errors.Is(err, pgoutbox.ErrPayloadTooLarge) {
		return "; here: pgoutbox publish --max-payload-bytes N"
	}
	if h := errtext.Hint(err); h != "" && !strings.Contains(err.Error(), h) {
		return h
	}
	if errors.As(err, &pgErr) && pgErr.Code == insufficientPrivilege {
		return "; the role lacks a privilege this command needs: grant it as docs/operations.md (Least privilege) and docs/ui.md list per action, or run the command as a role that has it"
	}
	return ""
}

// errHelp ends a run that printed help: exit code 0.
var errHelp = errors.New("help shown")

func (c *cli) dispatch(args []string) error {
	args = connectionFlagsLast(args)
	if len(args) == 0 {
		fmt.Fprint(c.stderr, mainUsage)
		return usagef("", "no command given")
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(c.stdout, mainUsage)
		return errHelp
	case "schema":
		return schemaPrivilegeHint(c.schemaCmd(rest))
	case "stats":
		return c.statsCmd(rest)
	case "health":
		return c.healthCmd(rest)
	case "dlq":
		return c.dlqCmd(rest)
	case "peek":
		return c.peekCmd(rest)
	case "publish":
		return c.publishCmd(rest)
	case "cancel":
		return c.cancelCmd(rest)
	case "bind":
		return c.bindCmd(rest)
	case "unbind":
		return c.unbindCmd(rest)
	case "pause", "resume":
		return c.pauseCmd(rest, cmd == "resume")
	case "ui":
		return c.uiCmd(rest)
	case "move":
		return c.moveCmd(rest)
	case "rename":
		return c.renameCmd(rest)
	case "version", "--version", "-version":
		return c.versionCmd(rest)
	}
	return usagef("", "unknown command %q; the commands are schema, stats, health, dlq, peek, publish, cancel, bind, unbind, move, rename, pause, resume, ui, version", cmd)
}

// undefinedTable is PostgreSQL's SQLSTATE for a missing table.
const undefinedTable = "42P01"
const insufficientPrivilege = "42501"

// connectionFlags are the flags every command takes (newCommand), and
// whether each takes a value: the connection and table flags, and what
// the outbox is (--rotating, --arrivals). --json, which every read command
// takes, may come first too: a command without it says so.
var connectionFlags = map[string]bool{"dsn": true, "schema": true, "table": true, "dlq-table": true, "no-dlq": false,
	"rotating": false, "arrivals": false, "json": false}

// connectionFlagsLast moves connection flags given before the command
// ("pgoutbox --dsn X stats", "pgoutbox --rotating stats") behind it, where
// the command parses them (before a "--" that ends its flags). Any other
// leading flag is left where it is: dispatch reports it.
func connectionFlagsLast(args []string) []string {
	var lead []string
	i := 0
	for i < len(args) && len(args[i]) > 1 && args[i][0] == '-' && args[i] != "--" {
		name, inline := strings.TrimLeft(args[i], "-"), false
		if k := strings.IndexByte(name, '='); k >= 0 {
			name, inline = name[:k], true
		}
		takesValue, ok := connectionFlags[name]
		if !ok {
			break
		}
		lead = append(lead, args[i])
		i++
		if takesValue && !inline && i < len(args) {
			lead = append(lead, args[i])
			i++
		}
	}
	if len(lead) == 0 {
		return args
	}
	rest := args[i:]
	if len(rest) == 0 {
		return nil // no command: dispatch says so
	}
	out := make([]string, 0, len(args))
	for j, a := range rest {
		if a == "--" {
			out = append(append(append(out, rest[:j]...), lead...), rest[j:]...)
			return out
		}
	}
	return append(append(out, rest...), lead...)
}
