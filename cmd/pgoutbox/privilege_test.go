package main

import (
	"context"
	"net/url"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// TestOperatorRoleWithoutArrivalsGrants: every outbox has an arrivals
// table, but a role granted what an outbox without arrivals needs (the
// subscriber grants of docs/operations.md, and DELETE on the bindings for
// unbind) binds, reads stats and peeks, and unbinds as before: the
// commands take the arrivals' paths only where the role may.
func TestOperatorRoleWithoutArrivalsGrants(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	asRole := roleEnv(t, env,
		[2]string{"SELECT, UPDATE, DELETE", "outbox"},
		[2]string{"SELECT, INSERT, DELETE", "outbox_bindings"},
		[2]string{"SELECT, INSERT", "outbox_dlq"},
		[2]string{"SELECT", "outbox_paused"})

	publish(t, env, "orders", "a")
	for _, args := range [][]string{
		{"bind", "--topic", "orders", "--group", "billing"},
		{"bind", "--topic", "orders", "--group", "invoicing"},
		{"stats"},
		{"peek", "--topic", "orders", "--group", "billing"},
		{"unbind", "--topic", "orders", "--group", "invoicing"},
	} {
		out, errOut, code := cliRun(t, asRole, args...)
		require.Equal(t, 0, code, "pgoutbox %s as a role without arrivals grants:\n%s%s", strings.Join(args, " "), out, errOut)
	}
}

// roleEnv returns env as seen by a new login role given grants (each a
// privilege list and a table of env's schema: "SELECT, INSERT", "outbox").
func roleEnv(t *testing.T, env *pgoutboxtest.Env, grants ...[2]string) *pgoutboxtest.Env {
	t.Helper()
	ctx := context.Background()
	role := "pgoxcli_" + strings.ToLower(watermill.NewShortUUID())[:10]
	s := `"` + env.Schema + `"`
	stmts := []string{`CREATE ROLE ` + role + ` LOGIN`, `GRANT USAGE ON SCHEMA ` + s + ` TO ` + role}
	for _, g := range grants {
		stmts = append(stmts, `GRANT `+g[0]+` ON `+s+`.`+g[1]+` TO `+role)
	}
	for _, stmt := range stmts {
		_, err := env.Pool.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	t.Cleanup(func() {
		_, _ = env.Pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = env.Pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	u, err := url.Parse(env.DSN)
	require.NoError(t, err)
	u.User = url.User(role)
	asRole := *env
	asRole.DSN = u.String()
	return &asRole
}

// TestBindWithoutAPrivilegeSaysBind: bind reads the topic's queues
// (Stats) before binding; a role that may not read the dead letters fails
// there, and the error says that bind failed, and that nothing was bound,
// not "stats:".
func TestBindWithoutAPrivilegeSaysBind(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	asRole := roleEnv(t, env,
		[2]string{"SELECT, UPDATE, DELETE", "outbox"},
		[2]string{"SELECT, INSERT", "outbox_bindings"},
		[2]string{"SELECT", "outbox_paused"}) // and nothing on outbox_dlq
	_, errOut, code := cliRun(t, asRole, "bind", "--topic", "orders", "--group", "billing")
	require.Equal(t, exitError, code, errOut)
	require.True(t, strings.HasPrefix(errOut, `pgoutbox: bind group billing to topic "orders": read the topic's queues first (nothing was bound): `), errOut)
	require.Contains(t, errOut, "permission denied for table outbox_dlq")
	require.NotContains(t, errOut, "stats:")
	require.Equal(t, 1, strings.Count(errOut, "pgoutbox:"), errOut)
}

// A role lacking a grant got PostgreSQL's bare "permission denied for
// table outbox_dlq"; the error now says where the grants are listed.
func TestPermissionDeniedSaysWhereTheGrantsAre(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	deadLetter(t, env, "orders", "x")
	// The subscriber role of docs/operations.md: no UPDATE/DELETE on the dead letters.
	asRole := roleEnv(t, env,
		[2]string{"SELECT, UPDATE, DELETE", "outbox"},
		[2]string{"SELECT, INSERT", "outbox_bindings"},
		[2]string{"SELECT, INSERT", "outbox_dlq"},
		[2]string{"SELECT", "outbox_paused"})
	for _, args := range [][]string{
		{"dlq", "requeue", "--all", "--yes"},
		{"dlq", "purge", "--older-than", "0", "--yes"},
		{"pause", "--topic", "orders", "--group", "billing"},
	} {
		_, errOut, code := cliRun(t, asRole, args...)
		require.Equal(t, exitError, code, errOut)
		require.Contains(t, errOut, "permission denied")
		require.Regexp(t, `(?i)grant|privilege`, errOut, "%v: the error should say which grant is missing or where the grants are documented", args)
	}
}

// A schema command run as an application role says to run it as the role
// that owns the outbox, not where the application roles' grants are.
func TestSchemaCommandWithoutAPrivilegeNamesTheMigrationRole(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	asRole := roleEnv(t, env,
		[2]string{"SELECT, UPDATE, DELETE", "outbox"},
		[2]string{"SELECT, INSERT", "outbox_bindings"},
		[2]string{"SELECT, INSERT", "outbox_dlq"},
		[2]string{"SELECT", "outbox_paused"})
	_, errOut, code := cliRun(t, asRole, "schema", "migrate", "status")
	require.Equal(t, exitError, code, errOut)
	require.Contains(t, errOut, "permission denied")
	require.Contains(t, errOut, "migration role that owns the outbox")
	require.NotContains(t, errOut, "docs/ui.md")
}
