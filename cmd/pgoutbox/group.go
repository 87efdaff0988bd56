package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// topicGroupFlags adds the --topic and --group flags of bind and unbind.
func topicGroupFlags(cmd *command) (topic, group *string) {
	topic = cmd.fs.String("topic", "", "the topic (required)")
	group = cmd.fs.String("group", "", "the consumer group (\"\" is the default group)")
	return topic, group
}

func (c *cli) bindCmd(args []string) error {
	cmd := c.newCommand("bind", "bind --topic T --group G",
		"  pgoutbox bind --topic orders.placed --group billing   # before the first deploy of billing\n", false)
	topic, group := topicGroupFlags(cmd)
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		if err := pgoutbox.Bind(ctx, exec, tables, *topic, *group); err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "bound group %s to topic %q: it gets every message published from now on\n", groupName(*group), *topic)
		return nil
	})
}

func (c *cli) unbindCmd(args []string) error {
	cmd := c.newCommand("unbind", "unbind --topic T --group G [--purge [--yes]]   (exits 1 when the group was not bound)",
		"  pgoutbox unbind --topic orders.placed --group old-service\n  pgoutbox unbind --topic orders.placed --group old-service --purge --yes\n", false)
	topic, group := topicGroupFlags(cmd)
	purge := cmd.fs.Bool("purge", false, "also delete the group's pending copies (asks for confirmation)")
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	confirm := func() error {
		if !*purge {
			return nil
		}
		return c.confirm(cmd.name+" --purge", fmt.Sprintf("Unbind group %s from %q and delete its pending messages?", groupName(*group), *topic), *yes)
	}
	return cmd.withOutbox(context.Background(), confirm, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		n, err := pgoutbox.Unbind(ctx, exec, tables, *topic, *group, *purge)
		if errors.Is(err, pgoutbox.ErrNotBound) {
			if *purge {
				fmt.Fprintf(c.stdout, "deleted %d pending message(s)\n", n)
			}
			return fmt.Errorf("group %s was not bound to topic %q; nothing was unbound (\"pgoutbox stats --topic %s\" lists its groups)", groupName(*group), *topic, *topic)
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "unbound group %s from topic %q", groupName(*group), *topic)
		if *purge {
			fmt.Fprintf(c.stdout, "; deleted %d pending message(s)", n)
		}
		fmt.Fprintln(c.stdout)
		return nil
	})
}
