package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/schemacheck"
)

func init() {
	register(&command{name: "schema", summary: "event schemas: `schema check` refuses incompatible changes (see --help)", run: runSchema})
}

const schemaSummary = "compare the event schemas of the working tree with a git revision and refuse incompatible changes"

func runSchema(ctx context.Context, args []string) error {
	if len(args) == 0 || args[0] != "check" {
		fmt.Fprintln(os.Stderr, "usage: km0 schema check [--against REV] [--history] [--repo DIR] [--dir schemas]")
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help" || args[0] == "help") {
			return nil
		}
		return cli.ErrUsage
	}
	return runSchemaCheck(ctx, os.Stdout, args[1:])
}

// runSchemaCheck is `km0 schema check` (package internal/schemacheck);
// schemacheck.ErrIncompatible makes km0 exit 1 after the violations were
// printed.
func runSchemaCheck(ctx context.Context, w io.Writer, args []string) error {
	fl := cli.NewFlags("schema check", schemaSummary)
	against := fl.String("against", "", "git revision to compare with (default: the merge base with main; "+
		"if that is HEAD or there is no main, HEAD~; with a single commit, only validate the tree)")
	history := fl.Bool("history", false, "also check every commit on the current branch that touched the schemas against its parent")
	repo := fl.String("repo", ".", "directory inside the git repository")
	dir := fl.String("dir", "schemas", "schemas directory, relative to the repository root")
	if err := cli.Parse(fl, args); err != nil {
		return err
	}
	return schemacheck.Check(ctx, w, schemacheck.Options{Against: *against, History: *history, Repo: *repo, Dir: *dir})
}
