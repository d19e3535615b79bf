# ruff: noqa
"""torchkeras' LightModel: all three ``*_step_end`` hooks, torchmetrics in a ModuleDict, epoch ends from the outputs.

Source:    https://github.com/lyhue1991/torchkeras
File:      torchkeras/lightmodel.py (class LightModel)
Commit:    761d796906194359d14711bcdc123bba477c7680 (the stored version of the file; torchkeras 3.x, Lightning 1.x)
Licence:   Apache-2.0 (LICENSE; its copyright line is the template's unfilled "Copyright [yyyy] [name of copyright
           owner]"; setup.py names the authors "lyhue1991,octopus,Laugh")

What the model does: a generic Keras-like wrapper around any ``net``: every step returns the per-replica loss, the
predictions and the targets; each ``*_step_end`` hook updates the stage's torchmetrics on the gathered predictions,
logs the training ones and averages the replicas' losses (``outputs["loss"].mean()``, which is how Lightning 1.x
``dp`` users combined them); the epoch ends compute the metrics, keep a history and print it. The README of the
project's Lightning 1.x era trained it with ``pl.Trainer(gpus=2)``, which Lightning 1.0-1.4 ran as ``dp``.

Changes to shrink it (the step bodies, the ``*_step_end`` hooks, ``configure_optimizers`` and the metric handling are
as written):
- Lightning 2.0 migration (docs/migrating.md): ``training_epoch_end(outputs)``, ``validation_epoch_end(outputs)`` and
  ``test_epoch_end(outputs)`` were removed: the outputs (what each ``*_step_end`` returned) are appended to lists in
  ``on_train_batch_end``/``on_validation_batch_end``/``on_test_batch_end``, and the bodies run in
  ``on_train_epoch_end``/``on_validation_epoch_end``/``on_test_epoch_end`` on those lists.
- ``build()`` below gives it a small MLP ``net``, ``nn.CrossEntropyLoss`` and ``{"acc": torchmetrics.Accuracy(...)}``
  (the torchkeras examples of the time used ``Accuracy()``; torchmetrics >= 0.11 needs ``task``/``num_classes``), in
  float64, and seeded 2-D points in three classes as data.
- pandas is not a dependency of this repository: ``import pandas as pd`` is replaced by a small ``pd.DataFrame``
  stand-in whose columns are lists, enough for ``get_history()[monitor]`` and ``np.argmax`` on it.
"""
import torch 
from torch import nn 
import datetime
import sys
import numpy as np
from copy import deepcopy
import pytorch_lightning as pl


class pd:
    """Stand-in for pandas (not a dependency here): ``DataFrame(rows)[column]`` is the column as a list."""

    @staticmethod
    def DataFrame(rows):
        rows = list(rows)
        return {key: [row.get(key, float("nan")) for row in rows] for row in rows for key in row}

class LightModel(pl.LightningModule):
    def __init__(self,net,loss_fn,metrics_dict=None,optimizer=None,lr_scheduler=None):
        super().__init__()
        self.net = net
        self.history = {}
        
        self.train_metrics = nn.ModuleDict(metrics_dict)
        self.val_metrics = deepcopy(self.train_metrics)
        self.test_metrics = deepcopy(self.train_metrics)
        
        self.loss_fn = loss_fn
        self.optimizer = optimizer if optimizer is not None else torch.optim.Adam(self.parameters(), lr=1e-2)
        self.lr_scheduler = lr_scheduler 
        
        for p in ["net","loss_fn","metrics_dict","optimizer","lr_scheduler"]:
            self.save_hyperparameters(p)
        # Lightning 2.0: the *_epoch_end(outputs) hooks were removed; the outputs are collected here
        self.step_outputs = {"train": [], "val": [], "test": []}
        
    def forward(self,x):
        if self.net:
            return self.net.forward(x)
        else:
            raise NotImplementedError
            
    def shared_step(self,batch,batch_idx):
        x, y = batch
        preds = self(x)
        loss = self.loss_fn(preds,y)
        return {'loss': loss, 'preds': preds.detach(), 'y': y.detach()}
    
    def configure_optimizers(self):
        if self.lr_scheduler is None:
            return self.optimizer
        return {"optimizer":self.optimizer,"lr_scheduler":self.lr_scheduler}
    
    def training_step(self, batch, batch_idx):
        return self.shared_step(batch,batch_idx)
    
    def validation_step(self, batch, batch_idx):
        return self.shared_step(batch,batch_idx)
    
    def test_step(self, batch, batch_idx):
        return self.shared_step(batch,batch_idx)
    
    def predict_step(self, batch, batch_idx):
        if isinstance(batch,list) and len(batch)==2:
            return self(batch[0])
        else:
            return self(batch)
        
    def shared_step_end(self,outputs,stage):
        metrics = self.train_metrics if stage=="train" else (
            self.val_metrics if stage=="val" else self.test_metrics)
        for name in metrics:
            step_metric = metrics[name](outputs['preds'], outputs['y']).item()
            if stage=="train":
                self.log(name,step_metric,prog_bar=True)
        return outputs["loss"].mean()
        
    def training_step_end(self, outputs):
        return {'loss':self.shared_step_end(outputs,"train")}
            
    def validation_step_end(self, outputs):
        return {'val_loss':self.shared_step_end(outputs,"val")}
            
    def test_step_end(self, outputs):
        return {'test_loss':self.shared_step_end(outputs,"test")}
            
    def shared_epoch_end(self,outputs,stage="train"):
        metrics = self.train_metrics if stage=="train" else (
            self.val_metrics if stage=="val" else self.test_metrics)
        
        epoch = self.trainer.current_epoch
        stage_loss = torch.mean(torch.tensor([t[(stage+"_loss").replace('train_','')] for t in outputs])).item()
        dic = {"epoch":epoch,stage+"_loss":stage_loss}
        
        for name in metrics:
            epoch_metric = metrics[name].compute().item() 
            metrics[name].reset()
            dic[stage+"_"+name] = epoch_metric 
        if stage!='test':
            self.history[epoch] = dict(self.history.get(epoch,{}),**dic)    
        return dic 

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_outputs["train"].append(outputs)

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.step_outputs["val"].append(outputs)

    def on_test_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.step_outputs["test"].append(outputs)

    def on_train_epoch_end(self):  # was training_epoch_end(self, outputs)
        outputs, self.step_outputs["train"] = self.step_outputs["train"], []
        dic = self.shared_epoch_end(outputs,stage="train")
        self.print(dic)
        dic.pop("epoch",None)
        self.log_dict(dic, logger=True)

    def on_validation_epoch_end(self):  # was validation_epoch_end(self, outputs)
        outputs, self.step_outputs["val"] = self.step_outputs["val"], []
        dic = self.shared_epoch_end(outputs,stage="val")
        self.print_bar()
        self.print(dic)
        dic.pop("epoch",None)
        self.log_dict(dic, logger=True)
        
        #log when reach best score
        ckpt_cb = self.trainer.checkpoint_callback
        monitor = ckpt_cb.monitor 
        mode = ckpt_cb.mode 
        arr_scores = self.get_history()[monitor]
        best_score_idx = np.argmax(arr_scores) if mode=="max" else np.argmin(arr_scores)
        if best_score_idx==len(arr_scores)-1:   
            self.print("<<<<<< reach best {0} : {1} >>>>>>".format(
                monitor,arr_scores[best_score_idx]),file = sys.stderr)
    
    def on_test_epoch_end(self):  # was test_epoch_end(self, outputs)
        outputs, self.step_outputs["test"] = self.step_outputs["test"], []
        dic = self.shared_epoch_end(outputs,stage="test")
        dic.pop("epoch",None)
        self.print(dic)
        self.log_dict(dic, logger=True)
        
    def get_history(self):
        return pd.DataFrame(self.history.values()) 
    
    def print_bar(self): 
        nowtime = datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')
        self.print("\n"+"="*80 + "%s"%nowtime)


# ------------------------------------------------------------------------------------------- the tests' stand-ins
def points(size: int, seed: int) -> torch.utils.data.TensorDataset:
    """Seeded 2-D points in float64, labelled by which of three rings around the origin they fall in."""
    generator = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(size, 2, generator=generator, dtype=torch.float64)
    radius = x.norm(dim=1)
    y = (radius > 1.5).long() + (radius > 3.0).long()
    return torch.utils.data.TensorDataset(x, y)


def build() -> LightModel:
    import torchmetrics

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    return LightModel(net, nn.CrossEntropyLoss(), {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)})
