package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/internal/envname"
	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// command is one subcommand's flag set, with the connection and table
// flags every command shares.
type command struct {
	name     string // "dlq requeue"
	fs       *flag.FlagSet
	dsn      string
	schema   string
	table    string
	dlqTable string
	noDLQ    bool
	rotating optBool // --rotating: given, or else read from the catalog
	arrivals bool    // --arrivals: given, or found in the catalog
	json     bool
	help     func() // prints --help
	envErr   error  // a variable the command reads is invalid: reported by parse
	// inspects: a command that only reads (stats, health, peek, dlq list
	// and show): withOutbox bounds it by readTimeout.
	inspects bool
}

// newCommand returns the flag set of a command. summary and examples
// make up its --help; readCmd adds --json.
func (c *cli) newCommand(name, usage, examples string, readCmd bool) *command {
	cmd := &command{name: name, fs: flag.NewFlagSet(name, flag.ContinueOnError)}
	fs := cmd.fs
	fs.SetOutput(io.Discard)
	fs.StringVar(&cmd.dsn, "dsn", "", "PostgreSQL DSN (else $PGOUTBOX_DSN, else $POSTGRES_DSN)")
	fs.StringVar(&cmd.schema, "schema", os.Getenv("PGOUTBOX_SCHEMA"), "schema of the tables ($PGOUTBOX_SCHEMA; default public)")
	fs.StringVar(&cmd.table, "table", os.Getenv("PGOUTBOX_TABLE"), "outbox table ($PGOUTBOX_TABLE; default outbox)")
	fs.StringVar(&cmd.dlqTable, "dlq-table", os.Getenv("PGOUTBOX_DLQ_TABLE"), "dead-letter table ($PGOUTBOX_DLQ_TABLE; default <table>_dlq)")
	var noDLQ bool
	if v := strings.TrimSpace(os.Getenv("PGOUTBOX_NO_DLQ")); v != "" {
		var err error
		if noDLQ, err = strconv.ParseBool(v); err != nil {
			cmd.envErr = usagef(name, "PGOUTBOX_NO_DLQ=%q is not valid; use true or false (or 1, 0), or unset it", v)
		}
	}
	fs.BoolVar(&cmd.noDLQ, "no-dlq", noDLQ, "the outbox has no dead-letter table ($PGOUTBOX_NO_DLQ)")
	if v := strings.TrimSpace(os.Getenv("PGOUTBOX_ROTATING")); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			cmd.envErr = usagef(name, "PGOUTBOX_ROTATING=%q is not valid; use true or false (or 1, 0), or unset it", v)
		}
		cmd.rotating = optBool{value: b, set: err == nil}
	}
	arrivals := false
	if v := strings.TrimSpace(os.Getenv("PGOUTBOX_ARRIVALS")); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			cmd.envErr = usagef(name, "PGOUTBOX_ARRIVALS=%q is not valid; use true or false (or 1, 0), or unset it", v)
		}
		arrivals = b
	}
	if bad := misspeltEnv(os.Environ()); bad != "" {
		cmd.envErr = usagef(name, "%s", bad)
	}
	fs.BoolVar(&cmd.arrivals, "arrivals", arrivals, "the outbox has an arrivals table ($PGOUTBOX_ARRIVALS); every single-table outbox has one from schema version 7 and the commands find it themselves, so this is only needed for an outbox of an earlier version that is being given one")
	fs.Var(&cmd.rotating, "rotating", "the outbox is a rotating one ($PGOUTBOX_ROTATING); schema sql and apply make one so; other commands read it from the database when not given")
	if readCmd {
		fs.BoolVar(&cmd.json, "json", false, "write one JSON document to stdout")
	}
	// The flag package calls Usage on every parse error; a usage error
	// prints one line and a hint instead, so help is printed on -h only.
	fs.Usage = func() {}
	cmd.help = func() {
		fmt.Fprintf(c.stdout, "Usage:\n  pgoutbox %s\n\nFlags:\n", usage)
		fs.SetOutput(c.stdout)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
		if examples != "" {
			fmt.Fprintf(c.stdout, "\nExamples:\n%s", examples)
		}
		fmt.Fprintf(c.stdout, "\n%s", exitCodesHelp)
	}
	return cmd
}

// envNames are the variables the commands read.
var envNames = []string{"PGOUTBOX_DSN", "PGOUTBOX_SCHEMA", "PGOUTBOX_TABLE", "PGOUTBOX_DLQ_TABLE", "PGOUTBOX_NO_DLQ",
	"PGOUTBOX_ROTATING", "PGOUTBOX_ARRIVALS", uiPasswordEnv, "POSTGRES_DSN"}

// misspeltEnv names a variable of environ that is one of envNames spelt
// with other case or underscores (pgoutbox_schema, PGOUTBOX_DLQTABLE), or
// "": read by nobody, it would leave a command on the default outbox
// without a word, where the library's *ConfigFromEnv refuse it.
func misspeltEnv(environ []string) string {
	for _, kv := range environ {
		key, _, _ := strings.Cut(kv, "=")
		for _, known := range envNames {
			if envname.Misspelt(key, known) && !slices.Contains(envNames, key) {
				return fmt.Sprintf("%s is not read (a misspelling?); use %s, or unset it", key, known)
			}
		}
	}
	return ""
}

// parse parses args, flags and positional arguments in any order, and
// returns the positional ones.
func (cmd *command) parse(args []string) ([]string, error) {
	var pos []string
	for {
		if err := cmd.fs.Parse(args); err != nil {
			if err == flag.ErrHelp {
				cmd.help()
				return nil, errHelp
			}
			return nil, usagef(cmd.name, "%v", err)
		}
		args = cmd.fs.Args()
		if len(args) == 0 {
			return pos, cmd.envErr
		}
		if args[0] == "--" {
			return append(pos, args[1:]...), cmd.envErr
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// given reports whether the flag name was on the command line.
func (cmd *command) given(name string) bool {
	found := false
	cmd.fs.Visit(func(f *flag.Flag) { found = found || f.Name == name })
	return found
}

// noArgs fails on positional arguments a command does not take.
func (cmd *command) noArgs(pos []string) error {
	if len(pos) > 0 {
		return usagef(cmd.name, "unexpected argument %q", pos[0])
	}
	return nil
}

// tables returns the table names from the flags and environment.
func (cmd *command) tables() (schema.Config, error) {
	t := schema.Config{Schema: cmd.schema, Table: cmd.table, DeadLetterTable: cmd.dlqTable, NoDeadLetterTable: cmd.noDLQ, Rotating: cmd.rotating.value, Arrivals: cmd.arrivals}
	if t.NoDeadLetterTable && t.DeadLetterTable != "" {
		return t, usagef(cmd.name, "--no-dlq and a dead-letter table (--dlq-table or $PGOUTBOX_DLQ_TABLE=%q) were both given; drop one", t.DeadLetterTable)
	}
	if t.Rotating && t.Arrivals {
		return t, usagef(cmd.name, "--rotating and --arrivals (or $PGOUTBOX_ROTATING and $PGOUTBOX_ARRIVALS) were both given; a rotating outbox has no arrivals table: drop --arrivals")
	}
	if err := t.Validate(); err != nil {
		return t, usagef(cmd.name, "%s; fix --schema, --table or --dlq-table (or their PGOUTBOX_* variables)", errtext.Trim(err))
	}
	return t, nil
}

// connect opens a pool on the DSN from --dsn, PGOUTBOX_DSN or POSTGRES_DSN.
func (cmd *command) connect(ctx context.Context) (*pgxpool.Pool, tx.Executor, error) {
	dsn := cmd.dsn
	if cmd.given("dsn") && strings.TrimSpace(dsn) == "" {
		// pgx reads a blank DSN as every default: the local server's
		// socket, as the operating system's user.
		return nil, nil, usagef(cmd.name, "--dsn is blank; give the database's DSN (e.g. postgres://user@host:5432/db?sslmode=disable), or leave --dsn out to use PGOUTBOX_DSN or POSTGRES_DSN")
	}
	if dsn == "" {
		dsn = strings.TrimSpace(os.Getenv("PGOUTBOX_DSN"))
	}
	if dsn == "" {
		dsn = strings.TrimSpace(os.Getenv("POSTGRES_DSN"))
	}
	if dsn == "" {
		return nil, nil, usagef(cmd.name, "no database given; pass --dsn or set PGOUTBOX_DSN (e.g. postgres://user@host:5432/db?sslmode=disable)")
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, nil, usagef(cmd.name, "the DSN does not parse (%v); use postgres://user:password@host:5432/db?sslmode=disable or key=value pairs", err)
	}
	cfg.MaxConns = 2
	if _, set := cfg.ConnConfig.RuntimeParams["client_encoding"]; !set {
		// pgx sends and reads UTF-8: on a LATIN1 database (or a role's
		// setting) the server would convert topics and keys as LATIN1,
		// and they would match nothing publishers stored in UTF-8.
		cfg.ConnConfig.RuntimeParams["client_encoding"] = "UTF8"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		hint := "check --dsn / PGOUTBOX_DSN and that the server is up"
		if errors.Is(err, context.DeadlineExceeded) {
			// A pooler that queues the connection times out the same way.
			hint += ", and, behind a connection pooler, that it is not paused and has a server connection free (PgBouncer: SHOW POOLS, cl_waiting)"
		}
		return nil, nil, fmt.Errorf("connect to %s:%d: %w; %s", cfg.ConnConfig.Host, cfg.ConnConfig.Port, err, hint)
	}
	return pool, tx.FromPgxPool(pool), nil
}

// optString is a string flag that knows whether it was given, so
// "--group ”" (the default group) differs from no --group.
type optString struct {
	value string
	set   bool
}

func (o *optString) String() string { return o.value }
func (o *optString) Set(s string) error {
	o.value, o.set = s, true
	return nil
}

// ptr returns the value, or nil when the flag was not given.
func (o *optString) ptr() *string {
	if !o.set {
		return nil
	}
	v := o.value
	return &v
}

// durationFlag is a Go duration whose parse error says how to write one
// (flag's own says only "parse error": a bare "5" is the usual mistake).
type durationFlag struct{ dst *time.Duration }

// durationVar defines a duration flag with default value on cmd.
func (cmd *command) durationVar(name string, value time.Duration, usage string) *time.Duration {
	d := value
	cmd.fs.Var(durationFlag{&d}, name, usage)
	return &d
}

func (f durationFlag) String() string {
	if f.dst == nil {
		return "0s" // the zero value, which flag's help leaves out
	}
	return f.dst.String()
}

func (f durationFlag) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		if wellFormedDuration.MatchString(s) {
			// ParseDuration says only "invalid" for a value past its range.
			return fmt.Errorf("%q is longer than a duration can be (about 292 years, %s)", s, time.Duration(math.MaxInt64).Truncate(time.Hour))
		}
		return fmt.Errorf("%q is not a duration; give it with its unit, as 30s, 5m or 1h30m", s)
	}
	*f.dst = d
	return nil
}

// wellFormedDuration is a duration's syntax, whatever its size.
var wellFormedDuration = regexp.MustCompile(`^[-+]?([0-9]*(\.[0-9]*)?(ns|us|µs|μs|ms|s|m|h))+$`)

// idList collects --id flags, repeated or comma-separated.
type idList []int64

func (l *idList) String() string { return fmt.Sprint([]int64(*l)) }
func (l *idList) Set(s string) error {
	for _, part := range strings.Split(s, ",") {
		id, err := strconv.ParseInt(strings.TrimSpace(part), 10, 64)
		if err != nil || id <= 0 {
			return fmt.Errorf("%q is not a dead-letter id (a positive integer, as dlq list shows)", part)
		}
		*l = append(*l, id)
	}
	return nil
}

// pairList collects repeated key=value flags.
type pairList [][2]string

func (l *pairList) String() string { return fmt.Sprint([][2]string(*l)) }
func (l *pairList) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return fmt.Errorf("%q is not key=value", s)
	}
	*l = append(*l, [2]string{k, v})
	return nil
}

// optBool is a boolean flag that knows whether it was given (on the
// command line or in the environment).
type optBool struct {
	value bool
	set   bool
}

func (o *optBool) String() string {
	if o == nil {
		return "false"
	}
	return strconv.FormatBool(o.value)
}

func (o *optBool) Set(v string) error {
	b, err := strconv.ParseBool(v)
	if err != nil {
		return fmt.Errorf("use true or false")
	}
	o.value, o.set = b, true
	return nil
}

// IsBoolFlag lets --rotating stand alone, as --rotating=true.
func (o *optBool) IsBoolFlag() bool { return true }
