// Package dockerpg starts PostgreSQL in a Docker container for
// pgoutboxtest, when no other server is found: it sets
// pgoutboxtest.StartServer, the last way pgoutboxtest.ServerDSN tries.
//
//	func TestMain(m *testing.M) { dockerpg.Main(m) }
//
// It is a module of its own (github.com/ory/dockertest/v3 and the Docker
// client come with it), so users of pgoutboxtest get no container library
// in their module graph unless they import this package.
//
// The container is started once per test binary, on first need, and
// removed when Main's tests end; it also expires after Expire, so a test
// binary that was killed leaves nothing running for long. Where no Docker
// engine answers, StartServer returns an error wrapping ErrNoDocker that
// says how to provide one (or another server).
package dockerpg

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/ory/dockertest/v3"
	"github.com/ory/dockertest/v3/docker"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
)

// Repository and Tag name the image StartServer runs. Default to
// "postgres" and "17". Set them before the tests run.
var (
	Repository = "postgres"
	Tag        = "17"
)

// Expire is how long the container may live: Docker removes it then even
// if Stop never ran. Defaults to 30 minutes; 0 means no limit.
var Expire = 30 * time.Minute

// ErrNoDocker is wrapped by StartServer's error when no Docker engine
// answers.
var ErrNoDocker = errors.New("dockerpg: no Docker engine answers")

var (
	mu       sync.Mutex
	pool     *dockertest.Pool
	resource *dockertest.Resource
)

// Main runs the tests of a package with StartServer as
// pgoutboxtest.StartServer (through pgoutboxtest.Run, which drops the test
// schemas), removes the container, and exits with the tests' code (1 if the
// container could not be removed).
func Main(m *testing.M) {
	pgoutboxtest.StartServer = StartServer
	code := pgoutboxtest.Run(m)
	if err := Stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// StartServer starts PostgreSQL (Repository:Tag, trust authentication for
// user postgres) in a container, waits until it accepts connections and
// returns its DSN. It fits pgoutboxtest.StartServer. A second call returns
// the running server's DSN.
func StartServer(ctx context.Context) (string, error) {
	mu.Lock()
	defer mu.Unlock()
	if resource != nil {
		return dsnOf(resource), nil
	}
	p, err := dockertest.NewPool("")
	if err == nil {
		err = p.Client.PingWithContext(ctx)
	}
	if err != nil {
		return "", fmt.Errorf("%w at %s: %v; start Docker (or set DOCKER_HOST to an engine that runs), "+
			"or give the tests a PostgreSQL server with POSTGRES_DSN", ErrNoDocker, endpoint(), err)
	}
	r, err := p.RunWithOptions(&dockertest.RunOptions{
		Repository: Repository,
		Tag:        Tag,
		Env:        []string{"POSTGRES_HOST_AUTH_METHOD=trust"},
		Cmd:        []string{"postgres", "-c", "max_connections=200", "-c", "fsync=off"},
	}, func(hc *docker.HostConfig) {
		hc.AutoRemove = true
		hc.RestartPolicy = docker.RestartPolicy{Name: "no"}
	})
	if err != nil {
		return "", fmt.Errorf("dockerpg: start %s:%s: %w; check that the image can be pulled (docker pull %s:%s)", Repository, Tag, err, Repository, Tag)
	}
	if Expire > 0 {
		_ = r.Expire(uint(Expire / time.Second))
	}
	dsn := dsnOf(r)
	p.MaxWait = time.Minute
	if d, ok := ctx.Deadline(); ok {
		p.MaxWait = time.Until(d)
	}
	if err := p.Retry(func() error {
		c, err := pgx.Connect(ctx, dsn)
		if err != nil {
			return err
		}
		return c.Close(ctx)
	}); err != nil {
		_ = p.Purge(r)
		return "", fmt.Errorf("dockerpg: PostgreSQL in container %s did not accept connections within %s: %w", r.Container.Name, p.MaxWait, err)
	}
	pool, resource = p, r
	return dsn, nil
}

// Stop removes the container StartServer started, if any.
func Stop() error {
	mu.Lock()
	defer mu.Unlock()
	if resource == nil {
		return nil
	}
	err := pool.Purge(resource)
	resource = nil
	if err != nil {
		return fmt.Errorf("dockerpg: remove container: %w", err)
	}
	return nil
}

func dsnOf(r *dockertest.Resource) string {
	return "postgres://postgres@" + r.GetHostPort("5432/tcp") + "/postgres?sslmode=disable"
}

// endpoint is where dockertest looks for the engine (DOCKER_HOST, else the
// default socket).
func endpoint() string {
	if h := os.Getenv("DOCKER_HOST"); h != "" {
		return h
	}
	return "unix:///var/run/docker.sock"
}
