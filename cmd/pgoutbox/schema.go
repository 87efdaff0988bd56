package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const schemaUsage = `Usage:
  pgoutbox schema sql       print the DDL (idempotent) for your migration tool
  pgoutbox schema apply     create the tables and indexes (needs DDL rights)
  pgoutbox schema validate  check the tables, columns and indexes; exit code 4 on problems
  pgoutbox schema migrate   versioned migrations: up, down, status, baseline, files
  pgoutbox schema convert-to-rotating
                            turn a single-table outbox into a rotating one, in place
  pgoutbox schema convert-to-single
                            turn a rotating outbox back into a single table, in place

Run "pgoutbox schema <sql|apply|validate|migrate|convert-to-rotating|convert-to-single> --help" for flags.
`

func (c *cli) schemaCmd(args []string) error {
	if len(args) == 0 {
		fmt.Fprint(c.stderr, schemaUsage)
		return usagef("schema", "missing subcommand: sql, apply, validate, migrate, convert-to-rotating or convert-to-single")
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(c.stdout, schemaUsage+"\n"+exitCodesHelp)
		return errHelp
	case "sql":
		return c.schemaSQL(args[1:])
	case "apply":
		return c.schemaApply(args[1:])
	case "validate":
		return c.schemaValidate(args[1:])
	case "migrate":
		return c.migrateCmd(args[1:])
	case "convert-to-rotating":
		return c.schemaConvert(args[1:], toRotating)
	case "convert-to-single":
		return c.schemaConvert(args[1:], toSingle)
	}
	return usagef("schema", "unknown subcommand %q; use sql, apply, validate, migrate, convert-to-rotating or convert-to-single", args[0])
}

func (c *cli) schemaSQL(args []string) error {
	cmd := c.newCommand("schema sql", "schema sql [--schema S] [--table T] [--dlq-table D | --no-dlq]",
		"  pgoutbox schema sql --schema app --table events > outbox.sql\n  (versioned files for goose or golang-migrate: pgoutbox schema migrate files)\n", false)
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	t, err := cmd.tables()
	if err != nil {
		return err
	}
	ddl, err := schema.SQL(t)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(c.stdout, ddl)
	return err
}

func (c *cli) schemaApply(args []string) error {
	cmd := c.newCommand("schema apply", "schema apply [connection flags]",
		"  pgoutbox schema apply --dsn postgres://admin@db/app\n", false)
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, t schema.Config) error {
		if err := schema.Create(ctx, exec, t); err != nil {
			if errtext.SQLState(err) == "55P03" { // a lock wait, not a privilege
				return lockWaitHint(err)
			}
			if errtext.SQLState(err) == "42501" { // insufficient_privilege
				return fmt.Errorf("%w (the role needs CREATE on the schema, or on the database while the schema does not exist; or apply \"pgoutbox schema sql\" with your migration tool)", err)
			}
			return err
		}
		t = t.WithDefaults()
		fmt.Fprintf(c.stdout, "schema applied: %s.%s", t.Schema, t.Table)
		if !t.NoDeadLetterTable {
			fmt.Fprintf(c.stdout, " and %s.%s", t.Schema, t.DeadLetterTable)
		}
		fmt.Fprintln(c.stdout)
		return nil
	})
}

func (c *cli) schemaValidate(args []string) error {
	cmd := c.newCommand("schema validate", "schema validate [--json] [connection flags]",
		"  pgoutbox schema validate && echo ok\n  pgoutbox schema validate --json\n", true)
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	problems := []string{}
	err := cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, t schema.Config) error {
		err := schema.Validate(ctx, exec, t)
		var ve *schema.ValidationError
		if errors.As(err, &ve) {
			problems = ve.Problems
			return nil
		}
		return err
	})
	if err != nil {
		return err
	}
	if cmd.json {
		if err := writeJSON(c.stdout, map[string]any{"ok": len(problems) == 0, "problems": problems}); err != nil {
			return err
		}
	} else if len(problems) == 0 {
		fmt.Fprintln(c.stdout, "schema ok")
	} else {
		for _, p := range problems {
			fmt.Fprintf(c.stdout, "problem: %s\n", p)
		}
		fmt.Fprintln(c.stderr, `pgoutbox: the schema does not match; "pgoutbox schema apply" makes whatever is missing; `+
			`"pgoutbox schema migrate up" (or "pgoutbox schema migrate files" with your migration tool) upgrades an outbox below the latest version`)
	}
	if len(problems) > 0 {
		return &problemsError{n: len(problems)}
	}
	return nil
}

// conversion is one direction of schema convert-to-rotating and
// convert-to-single: what it is called, says and does.
type conversion struct {
	// set is "set" or "unset": what the processes do to Rotating after.
	name, set, already, ask string
	done                    func(d schema.Config) string
	// toRotating is the direction: the outbox is rotating afterwards.
	toRotating bool
	run        func(context.Context, tx.Executor, schema.Config) error
}

var (
	toRotating = conversion{
		name: "convert-to-rotating", set: "set", already: "a rotating outbox",
		ask: "Convert %s.%s into a rotating outbox? Processes that keep the single table's setting can publish only plain messages (no keyed, scheduled or ordered ones) until they set Rotating and restart.",
		done: func(d schema.Config) string {
			return fmt.Sprintf("converted: %s.%s is a rotating outbox; its rows are in %s.", d.Schema, d.Table, query.Derive(d.Table, "_long"))
		},
		toRotating: true, run: schema.ConvertToRotating,
	}
	toSingle = conversion{
		name: "convert-to-single", set: "unset", already: "a single table",
		ask: "Convert %s.%s back into a single table? Processes that keep the rotating setting can publish only plain messages (no keyed, scheduled or ordered ones) until they unset Rotating and restart.",
		done: func(d schema.Config) string {
			return fmt.Sprintf("converted: %s.%s is a single table, with every row the rotating outbox had.", d.Schema, d.Table)
		},
		run: schema.ConvertToSingle,
	}
)

func (c *cli) schemaConvert(args []string, cv conversion) error {
	cmd := c.newCommand("schema "+cv.name, "schema "+cv.name+" [--yes] [connection flags]",
		"  pgoutbox schema "+cv.name+" --dsn postgres://owner@db/app --yes\n  (then "+cv.set+" Rotating in every publisher's and subscriber's Config, and restart them)\n", false)
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	// --rotating says what the outbox is, which is what this changes.
	cmd.rotating = optBool{}
	return cmd.withOutbox(context.Background(), nil,
		func(ctx context.Context, exec tx.Executor, t schema.Config) error {
			d := t.WithDefaults()
			if t.Rotating == cv.toRotating {
				fmt.Fprintf(c.stdout, "%s.%s is %s already; nothing to do\n", d.Schema, d.Table, cv.already)
				return nil
			}
			if err := c.confirm(cmd.name, fmt.Sprintf(cv.ask, d.Schema, d.Table), *yes); err != nil {
				return err
			}
			if err := cv.run(ctx, exec, t); err != nil {
				return err
			}
			fmt.Fprintf(c.stdout, "%s %s%s Rotating in every publisher's and subscriber's Config (pgoutbox commands find it out) and restart them.\n",
				cv.done(d), strings.ToUpper(cv.set[:1]), cv.set[1:])
			return nil
		})
}
