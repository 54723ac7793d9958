"""The test hub's storage routes: what `HfApi.list_lfs_files` and
`HfApi.permanently_delete_lfs_files` call (huggingface_hub 2.x, hf_api.py):

- GET  /api/{type}s/{repo}/lfs-files          one page of the repo's LFS objects; the next
                                              page's URL in a `Link: <...>; rel="next"` header
- POST /api/{type}s/{repo}/lfs-files/batch    {"deletions": {"sha": [...], "rewriteHistory": b}}

Mixed into HubHandler (tests/support/hub_handler.py); the state lives in hub_repo.HubState.
"""

from __future__ import annotations

import json

from .hub_repo import HubRefusal, git_oid, hub_date

LFS_FILES_ROUTES = [
    ({"GET"}, r"/lfs-files$", "lfs_files"),
    ({"POST"}, r"/lfs-files/batch$", "lfs_delete"),
]


class LfsFilesRoutes:
    def _lfs_files(self, args, query, authed, fault):
        repo = self._readable_repo(args, authed)
        with self.hub.state.lock:
            owned = sorted(repo.lfs.items(), key=lambda kv: (kv[1][1], kv[0]))
        start = int(query.get("cursor", 0))
        page = owned[start:start + self.hub.lfs_page_size]
        items = []
        for sha, (path, pushed_at) in page:
            size = self.hub.state.lfs_path(sha).stat().st_size
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n"
            items.append({"fileOid": sha, "oid": git_oid(pointer.encode()), "filename": path,
                          "pushedAt": hub_date(pushed_at), "ref": "refs/heads/main",
                          "size": size})
        headers = {}
        if start + len(page) < len(owned):
            kind = "datasets" if args["type"] == "dataset" else "models"
            headers["Link"] = (f'<{self.hub.url}/api/{kind}/{repo.repo_id}/lfs-files?cursor='
                               f'{start + len(page)}>; rel="next"')
        self._json(200, items, headers, fault)

    def _lfs_delete(self, args, query, authed, fault):
        repo = self._readable_repo(args, authed)
        deletions = json.loads(self._drain()).get("deletions") or {}
        if deletions.get("rewriteHistory") is not False:
            # Ours is never asked to rewrite history; a call that would must not pass unseen.
            raise HubRefusal(400, "this test hub only deletes with rewriteHistory=false")
        self.hub.state.delete_lfs(repo, list(deletions.get("sha") or []))
        self._json(200, {}, fault=fault)
