package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// version is the module version this binary was built from: the tag for
// `go install …/cmd/pgoutbox@v0.1.0`, "(devel)" for a build from a
// working tree.
func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "(devel)"
}

func (c *cli) versionCmd(args []string) error {
	cmd := c.newCommand("version", "version [--json]", "  pgoutbox version\n", true)
	cmd.envErr = nil // it reads no variable: a version for a bug report prints whatever they hold
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if cmd.json {
		return writeJSON(c.stdout, map[string]string{"version": version(), "go": runtime.Version()})
	}
	fmt.Fprintf(c.stdout, "pgoutbox %s (%s)\n", version(), runtime.Version())
	return nil
}
