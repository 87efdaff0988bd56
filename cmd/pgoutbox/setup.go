package main

import (
	"context"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// parseNoArgs parses args for a command that takes no positional
// arguments.
func (cmd *command) parseNoArgs(args []string) error {
	pos, err := cmd.parse(args)
	if err != nil {
		return err
	}
	return cmd.noArgs(pos)
}

// required fails when the flag --name was not given a value.
func (cmd *command) required(name, value string) error {
	if value == "" {
		return usagef(cmd.name, "--%s is required", name)
	}
	return nil
}

// limitInRange fails when --limit is outside 1..max.
func (cmd *command) limitInRange(limit, max int) error {
	if limit < 1 || limit > max {
		return usagef(cmd.name, "--limit %d is out of range; use 1 to %d", limit, max)
	}
	return nil
}

// withOutbox resolves the tables from the flags, runs before (when not
// nil: a confirmation, say) ahead of connecting, connects and calls fn
// with the connection and the tables. The pool is closed when fn returns.
func (cmd *command) withOutbox(ctx context.Context, before func() error,
	fn func(ctx context.Context, exec tx.Executor, tables schema.Config) error) error {
	tables, err := cmd.tables()
	if err != nil {
		return err
	}
	if before != nil {
		if err := before(); err != nil {
			return err
		}
	}
	pool, exec, err := cmd.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	return fn(ctx, exec, tables)
}
