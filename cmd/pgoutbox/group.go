package main

import (
	"context"
	"fmt"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

func (c *cli) bindCmd(args []string) error {
	cmd := c.newCommand("bind", "bind --topic T --group G",
		"  pgoutbox bind --topic orders.placed --group billing   # before the first deploy of billing\n", false)
	topic := cmd.fs.String("topic", "", "the topic (required)")
	group := cmd.fs.String("group", "", "the consumer group (\"\" is the default group)")
	pos, err := cmd.parse(args)
	if err != nil {
		return err
	}
	if err := cmd.noArgs(pos); err != nil {
		return err
	}
	if *topic == "" {
		return usagef(cmd.name, "--topic is required")
	}
	tables, err := cmd.tables()
	if err != nil {
		return err
	}
	ctx := context.Background()
	pool, exec, err := cmd.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pgoutbox.Bind(ctx, exec, tables, *topic, *group); err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "bound group %s to topic %q: it gets every message published from now on\n", groupName(*group), *topic)
	return nil
}

func (c *cli) unbindCmd(args []string) error {
	cmd := c.newCommand("unbind", "unbind --topic T --group G [--purge [--yes]]",
		"  pgoutbox unbind --topic orders.placed --group old-service\n  pgoutbox unbind --topic orders.placed --group old-service --purge --yes\n", false)
	topic := cmd.fs.String("topic", "", "the topic (required)")
	group := cmd.fs.String("group", "", "the consumer group (\"\" is the default group)")
	purge := cmd.fs.Bool("purge", false, "also delete the group's pending copies (asks for confirmation)")
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	pos, err := cmd.parse(args)
	if err != nil {
		return err
	}
	if err := cmd.noArgs(pos); err != nil {
		return err
	}
	if *topic == "" {
		return usagef(cmd.name, "--topic is required")
	}
	tables, err := cmd.tables()
	if err != nil {
		return err
	}
	if *purge {
		if err := c.confirm(cmd.name+" --purge", fmt.Sprintf("Unbind group %s from %q and delete its pending messages?", groupName(*group), *topic), *yes); err != nil {
			return err
		}
	}
	ctx := context.Background()
	pool, exec, err := cmd.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	n, err := pgoutbox.Unbind(ctx, exec, tables, *topic, *group, *purge)
	if err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "unbound group %s from topic %q", groupName(*group), *topic)
	if *purge {
		fmt.Fprintf(c.stdout, "; deleted %d pending message(s)", n)
	}
	fmt.Fprintln(c.stdout)
	return nil
}
